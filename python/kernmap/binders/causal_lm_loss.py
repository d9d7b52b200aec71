"""ForCausalLMLoss: the causal-LM forward of transformers' ``*ForCausalLM`` models (Qwen2, Qwen3, Llama, Mistral,
Qwen2-MoE, Qwen3-MoE, Mixtral, ...): ``logits = self.lm_head(hidden_states)``, then transformers'
``ForCausalLMLoss`` of those logits when labels are given. In training with labels the loss comes from the fused
op on the final hidden states and lm_head's weight (and bias), and the [tokens, vocab] logits are never made:
``outputs.logits`` is None, as with Liger's fused linear cross-entropy. Calls without labels, in eval mode
(``generate``, evaluation) or with a loss function other than ForCausalLMLoss run the model's own forward.

How (one call): the model's own forward runs with its arguments unchanged while, for that call only, lm_head's
forward computes the fused loss from the hidden states it is given and returns it in place of the logits, and
the model's ``loss_function`` hands that value on as the loss. So the model's code still slices
``logits_to_keep``, passes its kwargs and adds a MoE router's auxiliary loss (``loss += router_aux_loss_coef *
aux_loss``) itself, and the op runs inside lm_head's own call, where FSDP2's hooks have gathered its weight and
where autograd sees the weight lm_head uses (a tied embedding's gradient accumulates both uses). The binding is
per instance and looks its state up on ``self`` at each call, so that copies of a kernelized model are bound to
themselves."""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Callable

import torch
from torch import nn

from .base import Binder, bind_forward, original_forward

IGNORE_INDEX = -100  # transformers' ForCausalLMLoss default


def _transformers():
    """transformers' pieces the binding relies on (imported when a model is inspected: kernmap imports without
    transformers)."""
    from transformers import PreTrainedModel
    from transformers.loss.loss_utils import ForCausalLMLoss
    from transformers.utils.generic import can_return_tuple

    return PreTrainedModel, ForCausalLMLoss, can_return_tuple(lambda self: None).__code__


def head_problem(head: nn.Module | None) -> str | None:
    """Why lm_head's output is not ``F.linear(hidden, weight, bias)`` of its own weight and bias, or None."""
    if head is None:
        return "no lm_head module"
    cls = type(head).__name__
    if hasattr(head, "base_layer"):
        return (f"lm_head is wrapped by peft ({type(head).__module__}.{cls}): the fused loss would skip its "
                f"adapters")
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        return f"lm_head is {cls}, whose forward is not nn.Linear's (weight @ hidden + bias)"
    if "forward" in head.__dict__:
        return "lm_head's forward is replaced on the instance (hooks or another library)"
    weight = head.weight
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        return "lm_head's weight is not a floating [vocab, hidden] tensor"
    return None


def _logits_flow(function) -> str | None:
    """Why `function` (a causal-LM forward) does more with lm_head's output than hand it to self.loss_function
    and to the output, or None. A model that scales or soft-caps its logits (Gemma2, Cohere, Granite) does."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError) as e:
        return f"the source of its forward cannot be read ({type(e).__name__})"
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def is_self_call(node, attribute):
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attribute
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "self")

    heads = [n for n in ast.walk(tree) if is_self_call(n, "lm_head")]
    head_assign = parents.get(heads[0]) if len(heads) == 1 else None
    if not (isinstance(head_assign, ast.Assign) and [ast.unparse(t) for t in head_assign.targets] == ["logits"]):
        return "its forward does not call self.lm_head once, as logits = self.lm_head(...)"
    if not any(is_self_call(n, "loss_function") for n in ast.walk(tree)):
        return "its forward does not compute the loss with self.loss_function"
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Name) and node.id == "logits"):
            continue
        parent = parents[node]
        if isinstance(node.ctx, ast.Store):
            if parent is not head_assign:
                return f"its forward assigns logits again ({ast.unparse(parent)})"
            continue
        to_loss = isinstance(parent, ast.Call) and node in parent.args and is_self_call(parent, "loss_function")
        keyword = isinstance(parent, ast.keyword) and parent.arg == "logits"
        if not (to_loss or keyword):
            return f"its forward computes with the logits ({ast.unparse(parent)})"
    return None


def fused_loss(kernel: Callable, hidden: torch.Tensor, head: nn.Linear, targets: torch.Tensor, ignore_index: int,
               num_items_in_batch) -> torch.Tensor:
    """ForCausalLMLoss of ``head(hidden)`` against `targets` (already shifted), by the fused kernel."""
    weight, bias = head.weight, head.bias
    device = hidden.device.type
    if torch.is_autocast_enabled(device):  # the dtype autocast would compute lm_head's product in
        dtype = torch.get_autocast_dtype(device)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    if num_items_in_batch is not None:
        num_items_in_batch = torch.as_tensor(num_items_in_batch).to(hidden.device)
    return kernel(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1).to(hidden.device), bias,
                  ignore_index, num_items_in_batch)


def shifted_targets(labels: torch.Tensor, kwargs: dict, ignore_index: int) -> torch.Tensor:
    """transformers' ForCausalLMLoss targets: shift_labels when given, else labels shifted left by one with
    ignore_index appended."""
    shift_labels = kwargs.get("shift_labels")
    if shift_labels is not None:
        return shift_labels
    return nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _hand_on(logits, *args, **kwargs):
    """The model's loss_function during a fused call: lm_head's output is already the loss."""
    return logits


_MISSING = object()


def fused_forward(model: nn.Module, kernel: Callable, labels: torch.Tensor, args: tuple, kwargs: dict):
    """One call of the model's forward with the loss fused (see the module's docstring)."""
    head = model._modules["lm_head"]
    ignore_index = kwargs.get("ignore_index", IGNORE_INDEX)
    targets = shifted_targets(labels, kwargs, ignore_index)
    num_items_in_batch = kwargs.get("num_items_in_batch")
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = model.config.return_dict

    def head_forward(hidden_states):
        return fused_loss(kernel, hidden_states, head, targets, ignore_index, num_items_in_batch)

    loss_function = model.__dict__.get("_loss_function", _MISSING)
    head.forward = head_forward
    model.loss_function = _hand_on
    try:
        out = original_forward(model)(*args, return_dict=True, **kwargs)
    finally:
        del head.__dict__["forward"]
        if loss_function is _MISSING:
            del model.__dict__["_loss_function"]
        else:
            model.__dict__["_loss_function"] = loss_function
    out = type(out)(**{k: v for k, v in out.items() if k != "logits"})
    return out if return_dict else out.to_tuple()


class CausalLMLossBinder(Binder):
    layer = "ForCausalLMLoss"

    def recognises(self, module: nn.Module) -> bool:
        if not type(module).__name__.endswith("ForCausalLM") or "lm_head" not in module._modules:
            return False
        return isinstance(module, _transformers()[0])

    def unsupported(self, module: nn.Module) -> str | None:
        _, causal_lm_loss, tuple_wrapper = _transformers()
        cls = type(module).__name__
        problem = head_problem(module._modules["lm_head"])
        if problem:
            return problem
        loss_function = module.loss_function
        if loss_function is not causal_lm_loss:
            name = getattr(loss_function, "__name__", loss_function)
            return f"{cls}.loss_function is {name}, not transformers' ForCausalLMLoss"
        forward = inspect.getattr_static(type(module), "forward", None)
        if getattr(forward, "__code__", None) is not tuple_wrapper:
            return f"{cls}.forward is not decorated with transformers' can_return_tuple"
        inner = inspect.unwrap(forward)
        if "labels" not in inspect.signature(inner).parameters:
            return f"{cls}.forward takes no labels"
        flow = _logits_flow(inner)
        return f"{cls}: {flow}" if flow else None

    def dtype(self, module: nn.Module) -> torch.dtype | None:
        return module._modules["lm_head"].weight.dtype

    def change(self, module: nn.Module) -> str | None:
        return "training calls with labels: loss fused from lm_head.weight, outputs.logits None"

    def bind(self, module: nn.Module, kernel: Callable) -> None:
        parameters = list(inspect.signature(inspect.unwrap(type(module).forward)).parameters)
        module._kernmap_labels_at = parameters.index("labels") - 1  # positional index, self excluded
        causal_lm_loss = _transformers()[1]

        # The class forward's name and signature: the Trainer reads the forward's parameters to keep dataset
        # columns and to decide whether it passes num_items_in_batch.
        @functools.wraps(type(module).forward)
        def forward(self, *args, **kwargs):
            at = self._kernmap_labels_at
            labels = args[at] if len(args) > at else kwargs.get("labels")
            if (labels is None or not self.training or self.loss_function is not causal_lm_loss
                    or head_problem(self._modules.get("lm_head"))):
                return original_forward(self)(*args, **kwargs)
            return fused_forward(self, kernel, labels, args, kwargs)

        bind_forward(module, forward)
