"""Architecture tables: everything splicer knows about one model family's tensor names.

One module per architecture, each exposing an `Architecture` instance (table.py); here, the families by model type.
Nothing outside this package hard-codes a tensor or module name.
"""

from __future__ import annotations

from ..errors import SplicerError
from .table import Architecture


def families() -> tuple[Architecture, ...]:
    """Every architecture table, in the order model types are looked up."""
    from .deepseek_v3 import DEEPSEEK_V3
    from .dense import DENSE
    from .glm4_moe import GLM4_MOE
    from .qwen3_5_moe import QWEN3_5_MOE
    from .qwen3_moe import QWEN3_MOE
    from .qwen3_next import QWEN3_NEXT

    return (QWEN3_5_MOE, QWEN3_MOE, QWEN3_NEXT, DEEPSEEK_V3, GLM4_MOE, DENSE)


def all_classes() -> tuple[str, ...]:
    """Every module class some family has (a plan may name any of them; rows a family lacks are skipped)."""
    return tuple(dict.fromkeys(c for a in families() for c in a.classes))


def family_mismatch(model_type, tensor_names) -> str | None:
    """When the tensors fit another family's table better than the one model_type selects (more of them in a class
    there: qwen3_moe tensors labelled llama leave every routed expert under "other"), one line saying so and naming
    the family that fits; None when the table of model_type fits as well as any.

    Layer and expert numbers are folded to 0 first, so a model of 100 k tensors is classified from its few dozen
    distinct names. Tables are compared unbound (no MTP layer), each on the same names."""
    labelled = next((a for a in families() if model_type in a.model_types), None)
    if labelled is None:
        return None
    folded: dict[str, int] = {}
    for name in tensor_names:
        key = ".".join("0" if part.isdigit() else part for part in name.split("."))
        folded[key] = folded.get(key, 0) + 1

    def fit(arch: Architecture) -> tuple[int, int]:
        """(tensors in a class, -classes of the table no tensor is in): more named, then fewer classes unused."""
        classes = {k: arch.tensor_class(k) for k in folded}
        return (sum(n for k, n in folded.items() if classes[k] != "other"), -len(set(arch.classes) - set(classes.values())))

    have = fit(labelled)[0]
    scored = [(fit(a), a) for a in families() if a is not labelled]
    best = max((f for f, _ in scored), default=(0, 0))
    if best[0] <= have:
        return None
    fitting = [a for f, a in scored if f == best]
    unnamed = [k for k in folded if labelled.tensor_class(k) == "other" and fitting[0].tensor_class(k) != "other"]
    return (
        f"config.json says model_type {model_type!r}, but {sum(folded[k] for k in unnamed)} of its tensors fit no class of that "
        f"family's table (e.g. {unnamed[0]}) and the tensors fit {' or '.join(a.name for a in fitting)}: set "
        f"model_type to the checkpoint's own ({', '.join(t for a in fitting for t in a.model_types)}), as its "
        "export wrote it"
    )


def get_architecture(config: dict) -> Architecture:
    model_type = config.get("model_type")
    for arch in families():
        if model_type in arch.model_types:
            return arch.bind(config)
    known = ", ".join(t for a in families() for t in a.model_types)
    raise SplicerError(
        f"model_type {model_type!r} is not supported (supported: {known}); add an architecture table under splicer/arch/"
    )
