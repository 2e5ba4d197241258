"""learnroute: layer-wise routing of KV-cache eviction methods in HuggingFace LLMs."""

from learnroute._hf import attention_bias, routed_attention
from learnroute.adapter import Adapter, AdapterError, adapter_scope
from learnroute.budget_routes import BudgetRoutes, load_route_file, route_at
from learnroute.engine import Engine, Prefill, Prompt, RouteResult, build_prompt
from learnroute.methods import ALLOCATORS, METHODS, Method, allocate, get_method, method_names
from learnroute.models import DEFAULT_MODEL, load_model, model_name, tiny_llama
from learnroute.press import RoutedPress
from learnroute.route import LayerRoute, Route, RouteError

__version__ = "0.1.0"

__all__ = [
    "ALLOCATORS",
    "Adapter",
    "AdapterError",
    "BudgetRoutes",
    "DEFAULT_MODEL",
    "METHODS",
    "Engine",
    "LayerRoute",
    "Method",
    "Prefill",
    "Prompt",
    "Route",
    "RouteError",
    "RouteResult",
    "RoutedPress",
    "adapter_scope",
    "allocate",
    "attention_bias",
    "build_prompt",
    "get_method",
    "load_model",
    "load_route_file",
    "method_names",
    "model_name",
    "route_at",
    "routed_attention",
    "tiny_llama",
]
