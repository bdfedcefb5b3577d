"""The backends by name: their options (options_type, backend_options), their engines (backend_type) and how a results
table words their figures (results_wording). The interface they implement is base.py; nothing here imports a backend
module until its name is asked for.
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import SplicerError
from .base import KL_EXACT, ResultsWording

BACKENDS = ("torch", "vllm")  # the names --backend takes
DEFAULT_BACKEND = "torch"


def options_type(name: str) -> type:
    """The options class of backend NAME: what that backend takes beyond a device (fields), checks (on construction) and
    records (job.json, the base pass's cache key); every other stage reads a backend's options through it."""
    if name == "torch":
        from .torch_ref import TorchOptions

        return TorchOptions
    if name == "vllm":
        from .vllm_backend import VllmOptions

        return VllmOptions
    raise SplicerError(f"unknown backend {name!r}; choose {' or '.join(BACKENDS)}")


def backend_options(name: str, given: dict, device: str = "auto"):
    """The options of backend NAME from those the user gave (option -> value, only those set). An option of another
    backend is checked as that backend checks it (so a bad value says what it should be), then refused with that
    backend's line; the chosen backend's options check their combinations, and the device, where they are made."""
    chosen = options_type(name)
    for other in map(options_type, BACKENDS):
        owned = {k: v for k, v in given.items() if k in other.option_names() and k not in chosen.option_names()}
        if other is not chosen and owned:
            other(**owned)
            raise SplicerError(other.refused_elsewhere(owned))
    options = chosen(**given)
    options.check_device(device)
    return options


def backend_type(name: str) -> type:
    """The backend class of NAME: the engine that loads, scores, generates and times (base.Backend)."""
    return options_type(name).backend_type()


def results_wording(name, kl_support=None) -> ResultsWording:
    """How a results table words the figures of backend NAME (results.json's `backend`) measured as kl_support says
    (results.json's `kl_support`; None in a file written before it was recorded, worded as then); the defaults for a
    name no backend has."""
    wording = backend_type(name).results_wording if name in BACKENDS else ResultsWording()
    if kl_support == KL_EXACT and wording.kl_exact:
        return replace(wording, kl_bound=wording.kl_exact)
    return wording


def task_backend(name: str, settings: dict, device: str, log_dir):
    """The backend whose model lm-evaluation-harness scores (`splicer tasks`): backend NAME with the options a results
    folder's job recorded (settings), one engine at a time (its options' tasks()); it implements evaluate_tasks."""
    return options_type(name).from_job(settings).tasks().make_backends(device, log_dir)[0]


def drafter_backend(device: str, log_dir):
    """The backend that runs a row's MTP head teacher-forced (`splicer mtp --teacher-forced`): the torch reference,
    which builds the family's drafter from torch_mtp.py (check_drafter, load_drafter, draft_hits) on any folder."""
    return options_type("torch")().make_backends(device, log_dir)[0]
