import json

import pytest
from transformers import GPT2Config

import learnroute as lr
from learnroute.cli import main
from learnroute.demo import needle_sample


def test_help_lists_the_commands(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "demo" in out and "show" in out


def test_show_prints_a_route(tmp_path, capsys):
    path = lr.Route.from_layers(["snapkv", "tova"], [64, 0.5], model="m", source="test").to_file(tmp_path / "r.json")
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "snapkv" in out and "0.5" in out and "source=test" in out


def test_show_refuses_a_bad_file(tmp_path, capsys):
    bad = tmp_path / "r.json"
    bad.write_text(json.dumps({"layers": [{"method": "nope", "budget": 0}]}))
    with pytest.raises(SystemExit) as exit_:
        main(["show", str(bad)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unknown method 'nope'" in err and "budget 0" in err


@pytest.mark.slow
def test_default_model_is_smollm2_with_30_layers(smol):
    model, tok = smol
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3
    assert lr.model_name(model) == "SmolLM2-135M-Instruct"
    assert tok.chat_template is not None


def test_local_model_folder_loads(tmp_path, tokenizer):
    tiny = lr.tiny_llama(len(tokenizer), 2, eos_token_id=tokenizer.eos_token_id)
    tiny.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    model, tok = lr.load_model(tmp_path / "tiny")
    assert model.config.num_hidden_layers == 2 and len(tok) == len(tokenizer)


def test_unsupported_architecture_is_refused_before_loading_weights(tmp_path):
    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'.*Llama, Mistral, Qwen2, Qwen3, Phi3"):
        lr.load_model(tmp_path / "gpt2")


def test_a_folder_without_config_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        lr.load_model(tmp_path)


@pytest.mark.slow
def test_demo_runs_end_to_end(capsys):
    assert main(["demo", "--tokens", "500"]) == 0
    out = capsys.readouterr().out
    assert "full@1.0" in out and "% of full" in out and out.count("answer:") == 4


def test_demo_integer_budget_is_tokens_per_kv_head(tiny_dir, tokenizer, capsys):
    assert main(["demo", "--model", str(tiny_dir), "--tokens", "300", "--budget", "128"]) == 0
    out = capsys.readouterr().out
    assert "budget 128 tokens per KV head" in out
    # Independent count of the context the demo compresses: every compressed route keeps
    # 128 of its n tokens in every layer.
    sample = needle_sample(tokenizer, 300, depth=0.4, seed=0)
    n = lr.Engine(*lr.load_model(tiny_dir)).encode(sample.context, sample.question).context_ids.shape[1]
    assert n > 128
    assert out.count(f"({100 * 128 / n:5.1f}% of full)") == 3 and "(100.0% of full)" in out


@pytest.mark.parametrize(
    "budget, problem",
    [("0", "must be >= 1"), ("1.5", "must be in (0, 1]"), ("many", "neither an int >= 1 nor a float")],
)
def test_demo_refuses_a_bad_budget_before_loading_a_model(capsys, budget, problem):
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--budget", budget])
    assert exit_.value.code == 2
    assert problem in capsys.readouterr().err
