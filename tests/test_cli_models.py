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


def test_reshape_floors_caps_and_flattens_budgets_by_hand(tmp_path, capsys):
    """Heads 0.02 / 0.18 and 0.10 / 0.10 (mean 0.1). Floor 0.5: 0.5 + 0.5 x 4 x share of
    the mean = 0.6 / 1.4 / 1.0 / 1.0 -> 0.06 / 0.14 / 0.10 / 0.10. Cap 1.5: layer 0's 0.18
    over 1.5 x 0.1 gives its excess to the other head (0.05 / 0.15). Layer mean: 0.1 each.
    Floor 0.5 then cap 1.2: 0.06 / 0.14 -> 0.08 / 0.12. Methods stay per head."""
    heads = [[("tova", 0.02), ("snapkv", 0.18)], [("knorm", 0.1), ("tova", 0.1)]]
    route = lr.Route([lr.LayerRoute.per_head([lr.LayerRoute(m, b) for m, b in row]) for row in heads])
    path = route.to_file(tmp_path / "r.json")

    def got(**kw):
        out = route.reshaped(**kw)
        assert [[h.method for h in e.heads] for e in out.layers] == [[m for m, _ in row] for row in heads]
        return [b for row in out.head_budgets(2) for b in row]

    assert got(floor=0.5) == pytest.approx([0.06, 0.14, 0.1, 0.1])
    assert got(head_spread=1.5) == pytest.approx([0.05, 0.15, 0.1, 0.1])
    assert got(layer_mean=True) == pytest.approx([0.1] * 4)
    assert got(floor=0.5, head_spread=1.2) == pytest.approx([0.08, 0.12, 0.1, 0.1])
    layered = lr.Route.from_layers(["tova", "snapkv"], [0.02, 0.18])
    assert layered.reshaped(floor=0.5).budgets == pytest.approx([0.06, 0.14])

    assert main(["reshape", str(path), "--out", str(tmp_path / "f.json"), "--floor", "0.5"]) == 0
    assert sum(lr.Route.from_file(tmp_path / "f.json").head_budgets(2), []) == pytest.approx([0.06, 0.14, 0.1, 0.1])
    with pytest.raises(SystemExit):  # nothing is overwritten
        main(["reshape", str(path), "--out", str(tmp_path / "f.json"), "--floor", "0.2"])
    assert "exists" in capsys.readouterr().err
    assert sum(lr.Route.from_file(tmp_path / "f.json").head_budgets(2), []) == pytest.approx([0.06, 0.14, 0.1, 0.1])


def test_reshape_names_every_problem(tmp_path, capsys):
    tokens = lr.Route.from_layers(["tova", "snapkv"], [20, 60]).to_file(tmp_path / "t.json")
    with pytest.raises(SystemExit) as exit_:
        main(["reshape", str(tokens), "--out", str(tmp_path / "o.json"), "--floor", "1.5", "--head-spread", "0.5"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    for part in ("floor must be in [0, 1)", "head_spread must be >= 1", "they need a per-head route",
                 "this route has token budgets"):
        assert part in err
    assert not (tmp_path / "o.json").exists()
    with pytest.raises(lr.RouteError, match="nothing to do"):
        lr.Route.from_layers(["tova"], [0.1]).reshaped()
