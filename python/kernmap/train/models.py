"""The models of a run: a transformers causal LM from a Hugging Face folder, a config.json or a preset, and one
identical copy of it per run, set up as the run asks (experts implementation, peft LoRA, the kernels of the
selected layers, gradient checkpointing, DDP/FSDP2, torch.compile)."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, replace

import torch
from torch import nn

import kernmap
from kernmap import _kernelize, _registry, experts
from kernmap.binders import BINDERS

from . import presets
from .distributed import Parallel
from .errors import UsageError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WEIGHT_SEED = 0  # random weights (a preset or a config) and LoRA's initialisation


@dataclass
class Source:
    """Where the model comes from: exactly one of preset, model_dir, config_path."""

    preset: str | None = None
    model_dir: str | None = None
    config_path: str | None = None
    dtype: str = "float32"

    @property
    def name(self) -> str:
        return self.preset or self.model_dir or self.config_path

    def load(self) -> nn.Module:
        from transformers import AutoConfig, AutoModelForCausalLM

        dtype = DTYPES[self.dtype]
        if self.model_dir:
            return AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype)
        if self.config_path:
            with open(self.config_path, encoding="utf-8") as f:
                fields = json.load(f)
            if "model_type" not in fields:
                raise ValueError(f"--config {self.config_path}: no \"model_type\" key (a transformers config.json)")
            config = AutoConfig.for_model(**fields)
        else:
            config = presets.preset_config(self.preset)
        torch.manual_seed(WEIGHT_SEED)
        return AutoModelForCausalLM.from_config(config).to(dtype)


@dataclass
class Lora:
    """peft LoRA on the target modules ("all-linear" or a comma list of module names), dropout 0."""

    r: int
    alpha: float
    target: str = "all-linear"

    def apply(self, model: nn.Module) -> nn.Module:
        from peft import LoraConfig, get_peft_model

        target = self.target if self.target == "all-linear" else [t for t in self.target.split(",") if t]
        torch.manual_seed(WEIGHT_SEED)  # every run's adapters start from the same weights
        return get_peft_model(model, LoraConfig(r=self.r, lora_alpha=self.alpha, target_modules=target,
                                                lora_dropout=0.0))


@dataclass(frozen=True)
class Setup:
    """How one run's model differs from the loaded one."""

    layers: frozenset[str] = frozenset()  # the layers whose kernmap kernels are bound (kernelize)
    experts: str | None = None  # a transformers experts implementation ("eager", "grouped_mm", ...); None: the model's
    compile: bool = False
    float64: bool = False  # the layers bound to their float64 kernels instead (align's noise run)


def registered_layers() -> list[str]:
    return sorted({k["layer"] for k in kernmap.kernels() if k["provider"] == "reference"})


def parse_kernels(text: str) -> frozenset[str]:
    """"all", "none" or a comma list of layers (the C++ command's --kernels)."""
    layers = registered_layers()
    if text == "all":
        return frozenset(layers)
    if text == "none":
        return frozenset()
    chosen = text.split(",")
    for name in chosen:
        if name not in layers:
            raise UsageError(f"--kernels: unknown layer '{name}' (expected all, none or a comma list of "
                             f"{', '.join(layers)})")
    return frozenset(chosen)


def float64_kernel(layer: str) -> str | None:
    """The layer's float64 kernel (provider "float64": the reference's math from float64, rounded where the
    reference rounds), or None."""
    return next((k["name"] for k in kernmap.kernels() if k["layer"] == layer and k["provider"] == "float64"), None)


def bind_layers(model: nn.Module, layers: frozenset[str], device: str, float64: bool = False,
                compile: bool = False) -> kernmap.Report:  # noqa: A002 -- kernelize's keyword
    """kernelize for training (compile: only compile-safe kernels), then the modules of layers not in `layers`
    back to their own forward (the report says "not selected by --kernels"). float64: the selected layers on
    their float64 kernels (a layer without one keeps its own forward)."""
    mapping = {}
    if float64:
        mapping = {layer: {device: name} for layer in layers if (name := float64_kernel(layer))}
        layers = frozenset(mapping)
    with kernmap.use_mapping(mapping):
        report = kernmap.kernelize(model, mode="training", device=device, compile=compile)
    binders = {b.layer: b for b in BINDERS}
    rows = []
    for row in report.rows:
        if row.layer not in layers and not row.fallback:
            binders[row.layer].restore(model.get_submodule(row.path))
            row = replace(row, kernel=_registry._reference_name(row.layer), fallback=True,
                          reason="not selected by --kernels")
        rows.append(row)
    return kernmap.Report(report.device, report.mode, rows)


def layers_of(model: nn.Module, device: str) -> list[str]:
    """The layers the model's modules bear, each once, in the order they first appear (the model untouched)."""
    return list(dict.fromkeys(p.binder.layer for p in _kernelize._plan(model, device, "training")))


@dataclass
class Models:
    """The loaded model and what every run's copy gets."""

    base: nn.Module
    parallel: Parallel
    lora: Lora | None = None
    gradient_checkpointing: bool = False
    compile_backend: str = "inductor"  # torch.compile's backend for the +compile runs
    source: Source | None = None  # where base came from: release() lets make() load each copy from it again
    released: bool = False

    def release(self) -> None:
        """Frees the loaded weights (the base keeps its structure and config on the meta device); from now on
        make() loads every copy from the source again, as the first load did (the same seed or files), instead
        of copying the base: one model in memory instead of two, for a model of which two copies do not fit."""
        if self.source is None:
            raise ValueError("Models.release: no source to load the copies from")
        self.base = self.base.to("meta")
        self.released = True

    @property
    def pad_id(self) -> int:
        pad = getattr(self.base.config, "pad_token_id", None)
        return pad if isinstance(pad, int) and pad >= 0 else 0

    @property
    def default_experts(self) -> str | None:
        """The experts implementation transformers runs by default for this model (None: no experts)."""
        if not any(experts.is_experts_module(m) for m in self.base.modules()):
            return None
        return self.base.config._experts_implementation

    def make(self, setup: Setup) -> tuple[nn.Module, kernmap.Report | None]:
        """A fresh copy of the loaded model set up for one run, and its kernelize report (None when no layer is
        selected: the model as transformers runs it)."""
        model = self.source.load() if self.released else copy.deepcopy(self.base)
        if setup.experts is not None:
            model.set_experts_implementation(setup.experts)
        if self.lora is not None:
            model = self.lora.apply(model)
        report = (bind_layers(model, setup.layers, self.parallel.device, setup.float64, setup.compile)
                  if setup.layers else None)
        if self.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = self.parallel.wrap(model.to(self.parallel.device))
        if setup.compile:
            model = torch.compile(model, backend=self.compile_backend)
        return model, report
