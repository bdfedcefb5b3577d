"""vLLM 0.26's model-loader registry (`vllm/model_executor/model_loader/__init__.py`), reduced to what splicer's
expert-cache loader uses: register_model_loader and get_model_loader by load format."""

from .default_loader import BaseModelLoader, DefaultModelLoader

_LOAD_FORMAT_TO_MODEL_LOADER: dict = {"auto": DefaultModelLoader, "safetensors": DefaultModelLoader}


def register_model_loader(load_format: str):
    def _wrapper(cls):
        if not issubclass(cls, BaseModelLoader):
            raise ValueError("The model loader must be a subclass of `BaseModelLoader`.")
        _LOAD_FORMAT_TO_MODEL_LOADER[load_format] = cls
        return cls

    return _wrapper


def get_model_loader(load_config):
    if load_config.load_format not in _LOAD_FORMAT_TO_MODEL_LOADER:
        raise ValueError(f"Load format `{load_config.load_format}` is not supported")
    return _LOAD_FORMAT_TO_MODEL_LOADER[load_config.load_format](load_config)
