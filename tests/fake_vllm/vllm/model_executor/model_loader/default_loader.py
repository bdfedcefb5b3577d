"""vLLM 0.26's DefaultModelLoader (`model_loader/default_loader.py`), reduced to the methods and attributes splicer's
expert-cache loader relies on, with their 0.26 signatures: Source, _prepare_weights (folder, files, use_safetensors),
_get_weights_iterator (one get_tensor per name, the source's prefix applied), get_all_weights, load_weights (the model's
load_weights over every weight; strict tracking for unquantized models) and counter_before_loading_weights."""

from __future__ import annotations

import glob
import os
import time
from dataclasses import dataclass


class BaseModelLoader:
    def __init__(self, load_config):
        self.load_config = load_config


class DefaultModelLoader(BaseModelLoader):
    @dataclass
    class Source:
        model_or_path: str
        revision: str | None
        prefix: str = ""
        fall_back_to_pt: bool = True
        allow_patterns_overrides: list | None = None
        subfolder: str | None = None

    counter_before_loading_weights: float = 0.0
    counter_after_loading_weights: float = 0.0

    def __init__(self, load_config):
        super().__init__(load_config)
        extra = getattr(load_config, "model_loader_extra_config", None) or {}
        unexpected = set(extra) - {"enable_multithread_load", "num_threads", "enable_weights_track"}
        if unexpected:
            raise ValueError(f"Unexpected extra config keys for load format {load_config.load_format}: {unexpected}")
        self.enable_weights_track = extra.get("enable_weights_track")
        self.reads: list[str] = []  # names read from the checkpoint (the fake's own record, for tests)

    def _prepare_weights(self, model_name_or_path, subfolder, revision, fall_back_to_pt, allow_patterns_overrides):
        # 0.26 picks the files by load_format and refuses a name it does not know (default_loader.py:166-184), a
        # registered loader's own name included
        if self.load_config.load_format not in ("auto", "hf", "safetensors", "fastsafetensors", "instanttensor"):
            raise ValueError(f"Unknown load_format: {self.load_config.load_format}")
        files = sorted(glob.glob(os.path.join(model_name_or_path, "*.safetensors")))
        return model_name_or_path, files, bool(files)

    def _get_weights_iterator(self, source):
        from safetensors import safe_open

        _, files, _ = self._prepare_weights(
            source.model_or_path, source.subfolder, source.revision, source.fall_back_to_pt, source.allow_patterns_overrides
        )

        def it():
            for path in files:
                with safe_open(path, framework="pt") as f:
                    for name in f.keys():  # noqa: SIM118
                        self.reads.append(name)
                        yield name, f.get_tensor(name)

        if self.counter_before_loading_weights == 0.0:
            self.counter_before_loading_weights = time.perf_counter()
        return ((source.prefix + n, t) for n, t in it())

    def get_all_weights(self, model_config, model):
        yield from self._get_weights_iterator(DefaultModelLoader.Source(model_config.model, None))

    def load_weights(self, model, model_config) -> None:
        loaded = model.load_weights(self.get_all_weights(model_config, model))
        self.counter_after_loading_weights = time.perf_counter()
        track = self.enable_weights_track
        if track is None:
            track = getattr(model_config, "quantization", None) is None and loaded is not None
        if track:
            missing = {n for n, _ in model.named_parameters()} - set(loaded)
            if missing:
                raise ValueError(f"Following weights were not initialized from checkpoint: {sorted(missing)}")
