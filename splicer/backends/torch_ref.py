"""Reference backend: transformers' own text model of the checkpoint's family, in BF16, on CPU or CUDA.

Packed modules are dequantized with compressed-tensors' own dequantizer, layer by layer,
so the model sees exactly the weights the INT4 kernels approximate. It sees the full
vocabulary (exact KL) and runs no batch-dependent MoE kernels, which makes it the
reference for tests and the demo and a kernel-free fidelity measure on a GPU.
"""

from __future__ import annotations

import contextlib
import logging
import re
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from ..checkpoint import open_checkpoint
from ..errors import SplicerError
from .base import OneEngineAtATime, ResultsWording, SequenceScores, decode_summary
from .cpu_threads import set_torch_threads


def _read_tensors(ckpt, names) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors of these names, each shard opened once."""
    from safetensors import safe_open

    by_shard: dict[str, list[str]] = defaultdict(list)
    for name in names:
        by_shard[ckpt.weight_map[name]].append(name)
    raw: dict[str, torch.Tensor] = {}
    for shard, shard_names in by_shard.items():
        with safe_open(str(ckpt.root / shard), "pt") as f:
            for n in shard_names:
                raw[n] = f.get_tensor(n)
    return raw


class _Bf16InFp32(torch.overrides.TorchFunctionMode):
    """BF16 matrix products and convolutions on the CPU as FP32 ones of the same BF16 values, rounded back to BF16.

    Why: a BF16 GEMM or convolution accumulates in FP32 and rounds its output to BF16 (on GPUs and in torch's CPU
    kernels alike), so this is the same arithmetic but for the order of the sums (an output differs from torch's BF16
    kernel by one BF16 step now and then, more where terms cancel); but on a CPU without BF16 units (AVX2 only)
    torch's BF16 GEMM is about ten times slower than its FP32 one (results/cpu-bf16-matmul), and its conv1d (the
    Gated-DeltaNet layers' depthwise short convolution) two to twelve times (results/cpu-bf16-conv1d).
    matmuls=True: around the scoring passes (score, draft_hits, lm-eval's log-likelihood forward), where every product
    has many rows and converting the weight to FP32 costs less than it saves. matmuls=False: convolutions only, for
    generation and decode timing of a model that has a Conv1d, one row at a time, where converting every GEMM weight
    per token would cost more than it saves but a convolution's weight (channels × kernel width) costs next to nothing
    (a model without one runs with no mode at all: the mode's Python call around every op would only slow it).
    Only these functions, and only when every floating-point tensor among their arguments is BF16 and no out= tensor is
    given; everything else (attention through scaled_dot_product_attention, norms, activations) runs as before."""

    MATMULS = frozenset(
        f
        for f in (
            torch.nn.functional.linear,
            torch.matmul,
            torch.bmm,
            torch.Tensor.__matmul__,
            getattr(torch, "_grouped_mm", None),
        )
        if f is not None
    )
    CONVS = frozenset({torch.nn.functional.conv1d})

    def __init__(self, matmuls: bool = True):
        super().__init__()
        self.funcs = (self.MATMULS | self.CONVS) if matmuls else self.CONVS

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.funcs and kwargs.get("out") is None:
            floats = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.is_floating_point()]
            if floats and all(a.dtype == torch.bfloat16 for a in floats):

                def up(a):
                    return a.float() if isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 else a

                return func(*map(up, args), **{k: up(v) for k, v in kwargs.items()}).to(torch.bfloat16)
        return func(*args, **kwargs)


def _fill(params: dict, tensors: dict, folder, place: str, prefix: str = "") -> set[str]:
    """Copy tensors (by the module's own names) into params (a state_dict with keep_vars); a name with no place there
    or of another shape is one line naming folder and the checkpoint's name (prefix + name). Returns the names filled."""
    for name, tensor in tensors.items():
        if name not in params:
            raise SplicerError(f"{folder}: tensor {prefix}{name} has no place in {place}")
        p = params[name]
        if tuple(p.shape) != tuple(tensor.shape):
            raise SplicerError(f"{folder}: {prefix}{name} is {list(tensor.shape)} but the config implies {list(p.shape)}")
        with torch.no_grad():
            p.copy_(tensor.to(p.dtype))
    return set(tensors)


def _require(required: set, filled: set, folder, prefix: str, why: str) -> None:
    """Every parameter filled, or one line naming the first missing one (by the checkpoint's name, prefix + name)."""
    missing = sorted(required - filled)
    if missing:
        raise SplicerError(f"{folder}: no weights for {prefix}{missing[0]} (and {len(missing) - 1} more); {why}")


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # The reference runs where its weights can live and be timed: the CPU or a CUDA device (cuda, cuda:N).
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise SplicerError(f"--device {device!r} is not one the torch backend runs on; use auto, cpu, cuda or cuda:N")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SplicerError(f"--device {device} asked for, but torch sees no CUDA device; use --device cpu")
        if ":" in device and int(device.split(":")[1]) >= torch.cuda.device_count():
            raise SplicerError(f"--device {device}: torch sees {torch.cuda.device_count()} CUDA devices; pick one of them")
    return torch.device(device)


def _cuda_kernel_advice_on_cpu(record: logging.LogRecord) -> bool:
    """A logging filter: transformers (5.2x) advises installing causal-conv1d and flash-linear-attention whenever a GDN
    layer runs their PyTorch fallbacks; both are CUDA kernels, so on the CPU (the demo, the tests) the advice does not
    apply and only clutters the output. Every other record passes."""
    return "falling back to its reference PyTorch implementation" not in record.getMessage()


class TorchBackend(OneEngineAtATime):
    name = "torch"
    exact_gather = True
    results_wording = ResultsWording()  # exact log-probs at the base's top-k ids; transformers logs no engine start
    default_batch = 4
    # one model in this process at a time, nothing compiled: nothing to do ahead (OneEngineAtATime)

    # How a scoring pass (score, draft_hits, lm-eval's log-likelihoods) computes its products and convolutions, and
    # generation its convolutions (_scoring_products, _generation_products; job_settings, describe and task_model
    # record it: rows computed otherwise are another job or task run, never mixed with these).
    SCORING_PRODUCTS = (
        "BF16 products and convolutions as FP32 ones of the BF16 values, rounded to BF16, on the CPU "
        "(in generation and decode timing, the convolutions only)"
    )
    # What the model is built in (load: from_config's dtype): recorded beside SCORING_PRODUCTS because a job begun
    # while a config's own dtype won (a GPTQ export's float16 inside text_config) holds rows of another arithmetic.
    MODEL_DTYPE = "the backend's dtype, whatever the checkpoint's config names"

    def __init__(self, device: str = "auto", dtype: str = "bfloat16", threads: int | None = None):
        self.device = pick_device(device)
        if self.device.type == "cpu":
            logging.getLogger("transformers.integrations.hub_kernels").addFilter(_cuda_kernel_advice_on_cpu)
        self.dtype = getattr(torch, dtype)
        # Chosen from the cores free now unless the user set a count: a thread more than the free cores makes every
        # step wait on it (cpu_threads.choose_threads). Said once in the run's log.
        self.threads_note = set_torch_threads(threads)
        self.model = None
        self.folder: Path | None = None

    # ------------------------------------------------------------ loading
    def load(self, folder: Path) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        self.unload()
        ckpt = open_checkpoint(folder, "checkpoint")
        arch = ckpt.arch
        cfg_dict = {
            k: v for k, v in ckpt.config.items() if k not in ("quantization_config", "model_type", "transformers_version")
        }
        # transformers' own config and causal-LM classes for the model type (the text model of a multimodal one).
        text_cfg = AutoConfig.for_model(arch.transformers_model_type(ckpt.config["model_type"]), **cfg_dict)
        if arch.text_config_key:
            text_cfg = getattr(text_cfg, arch.text_config_key)
        text_cfg._attn_implementation = "sdpa"
        self.max_positions = text_cfg.max_position_embeddings
        # dtype given: from_config would otherwise build in the config's dtype (a GPTQ export often says float16),
        # whatever this backend computes in and records (describe, job settings)
        model = self._unfilled(lambda: AutoModelForCausalLM.from_config(text_cfg, dtype=self.dtype))
        # Parameters and persistent buffers (DeepSeek's router keeps e_score_correction_bias as a buffer); every
        # parameter must be filled, a buffer the checkpoint lacks keeps the value the model class gives it.
        params = dict(model.state_dict(keep_vars=True))
        required = set(dict(model.named_parameters()))
        filled: set[str] = set()
        schemes = self._module_schemes(ckpt) if ckpt.quantization_config else {}
        chunks: dict[object, list[str]] = defaultdict(list)
        text = re.compile(arch.text_tensor_pattern)
        for name in ckpt.weight_map:
            if text.match(name) and not arch.is_mtp(name):
                chunks[ckpt.arch.layer_index(name)].append(name)
        for key in sorted(chunks, key=lambda k: (k is None, k or 0)):
            raw = self._dequantize(_read_tensors(ckpt, chunks[key]), schemes)
            filled |= _fill(
                params,
                self._to_model_names(raw, arch),
                folder,
                f"the text model; is this a {arch.name} checkpoint?",
            )
        _require(required, filled, folder, "", "the checkpoint is incomplete")
        model.eval()
        self.model = model
        self.folder = Path(folder)

    def _unfilled(self, make):
        """make()'s module built on this backend's device and dtype with no weight initialised (the checkpoint fills
        every parameter, and initialising a model that is overwritten costs seconds)."""
        try:
            from transformers.initialization import no_init_weights
        except ImportError:  # transformers < 5
            from transformers.modeling_utils import no_init_weights

        default = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with no_init_weights(), self.device:
                return make()
        finally:
            torch.set_default_dtype(default)

    # What `splicer tasks` records as the model lm-eval scored (tasks.json's settings: another model is another run),
    # with how its log-likelihoods compute their products. task_models_before: what this backend recorded before its
    # arithmetic changed; a tasks.json of one runs its rows again, saying why (no option gives the old arithmetic back).
    _HFLM = "torch backend (transformers' model of the family) through lm-eval's HFLM"
    task_model = f"{_HFLM}; log-likelihoods: {SCORING_PRODUCTS}"
    task_models_before = (
        _HFLM,  # as recorded while its log-likelihoods ran torch's BF16 GEMM
        f"{_HFLM}; log-likelihoods: BF16 products as FP32 products of the BF16 values, rounded to BF16, on the CPU",
    )  # the second: before the convolutions were computed in FP32 too

    def evaluate_tasks(self, folder: Path, tokenizer_folder: Path, request: dict, log_name: str | None = None) -> dict:
        """lm-eval's tasks on folder's model in this process (lm_eval_tasks.evaluate: request and what comes back);
        log_name goes unused: lm-eval runs in this process, whose output is the command's own, and writes no log."""
        from .lm_eval_tasks import evaluate

        self.load(folder)
        try:
            dtype = str(next(self._need().parameters()).dtype).replace("torch.", "")
            res = evaluate(self.lm_eval_model(tokenizer_folder, int(request.get("batch_size") or 8)), request)
            return {**res, "engine": {"dtype": dtype}}
        finally:
            self.unload()

    def lm_eval_model(self, tokenizer_folder: Path, batch_size: int = 8):
        """The loaded model as lm-evaluation-harness's HF model (its own log-likelihood and generation code over this
        very model instance), with the base's tokenizer; its log-likelihood forward under _scoring_products, as score()
        runs (torch_hflm.ScoringProductsHFLM), its generation under _generation_products, as generate() runs."""
        from lm_eval.utils import setup_logging
        from transformers import AutoTokenizer

        from .torch_hflm import ScoringProductsHFLM

        # lm-eval's logger at the level evaluate() sets anyway (LMEVAL_LOG_LEVEL overrides both), before the model is
        # made: else HFLM warns on every row that `pretrained` is no string, which is how splicer hands it the model
        setup_logging("ERROR")
        tok = AutoTokenizer.from_pretrained(str(tokenizer_folder))
        return ScoringProductsHFLM(
            pretrained=self._need(),
            tokenizer=tok,
            batch_size=batch_size,
            device=str(self.device),
            products=self._scoring_products,
            generation_products=self._generation_products,
        )

    @classmethod
    def check_readable(cls, ckpt, modules: dict | None = None) -> None:
        """Refuse, in one line, a checkpoint whose format this backend cannot dequantize (before a run starts).
        modules: its list_modules, when the caller has them."""
        cls._module_schemes(ckpt, modules)

    @staticmethod
    def _module_schemes(ckpt, modules: dict | None = None) -> dict:
        """Quantized module -> (its Module, what to dequantize it with), as the checkpoint's format reads its config
        (formats.base.QuantFormat.torch_schemes)."""
        from ..formats.registry import format_or_default, unreadable
        from ..splice.modules import list_modules

        qc = ckpt.quantization_config
        why = unreadable(qc)
        if why:
            raise SplicerError(f"{ckpt.label}: the torch backend cannot read {why}; score it with --backend vllm")
        modules = {n: m for n, m in (modules if modules is not None else list_modules(ckpt)).items() if m.quantized}
        return format_or_default(qc).torch_schemes(ckpt, qc, modules)

    def _dequantize(self, raw: dict, schemes: dict) -> dict:
        from ..formats.awq_tensors import dequantize_awq
        from ..formats.gptq_tensors import dequantize_gptq
        from ..formats.layouts import LAYOUT
        from ..formats.quantize import dequantize_module

        out = dict(raw)
        # Only the modules whose tensors are in this chunk (one decoder layer): not every module of the model per chunk.
        for module in {k.rpartition(".")[0] for k in raw} & schemes.keys():
            m, scheme = schemes[module]
            layout = LAYOUT[m.layout]
            local = {s: out.pop(f"{module}.{s}") for s in layout.suffixes if f"{module}.{s}" in out}
            if m.layout == "gptq":
                out[f"{module}.weight"] = dequantize_gptq(local, scheme, self.dtype)
            elif m.layout == "awq":
                out[f"{module}.weight"] = dequantize_awq(local, scheme, self.dtype)
            else:
                out[f"{module}.weight"] = dequantize_module(local, scheme, self.dtype)
        return out

    @staticmethod
    def _to_model_names(raw: dict[str, torch.Tensor], arch) -> dict[str, torch.Tensor]:
        """Checkpoint names -> the HF text model's names (the family's prefix map); per-expert weights stacked into
        transformers' fused 3-D expert tensors (the family's fused_expert_shards, rows in their order)."""
        out: dict[str, torch.Tensor] = {}
        experts: dict[str, dict[int, dict[str, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
        for name, t in raw.items():
            module, _, leaf = name.rpartition(".")
            parts = arch.expert_parts(module) if leaf == "weight" else None
            if parts:
                experts[parts[0]][parts[1]][parts[2]] = t
            else:
                out[name] = t
        for prefix, per in experts.items():
            idx = sorted(per)
            for fused, projs in arch.fused_expert_shards:
                out[f"{prefix}.{fused}"] = torch.stack([torch.cat([per[e][p] for p in projs], 0) for e in idx])
        renamed = {}
        for name, t in out.items():
            for ckpt_prefix, model_prefix in arch.hf_prefix_map:
                if name.startswith(ckpt_prefix):
                    name = model_prefix + name[len(ckpt_prefix) :]
                    break
            renamed[name] = t
        return renamed

    def load_info(self) -> dict:
        return {}

    def abort(self) -> None:
        """Nothing runs in another process; close() frees the model."""

    def close(self) -> None:
        self.unload()

    def unload(self) -> None:
        self.model = None
        self.drafter = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def hold_exact_gather(self, exact: bool) -> None:
        """The full vocabulary is always at hand here, so every base pass of this backend gathered exactly."""
        if not exact:
            raise SplicerError(
                "this run's base pass was scored without exact log-probs at the base's top-k ids, which the torch "
                "backend always gathers: run the plan into a new folder"
            )

    def _need(self):
        if self.model is None:
            raise RuntimeError("load() a checkpoint first")
        return self.model

    # ------------------------------------------------------------ scoring
    def _on_cpu_bf16(self, model) -> bool:
        """A BF16 model on the CPU (the model's own dtype: a config may set another)."""
        params = getattr(model, "parameters", None)
        first = next(iter(params()), None) if callable(params) else None
        return self.device.type == "cpu" and (first.dtype if first is not None else self.dtype) == torch.bfloat16

    def _scoring_products(self, model):
        """_Bf16InFp32 (products and convolutions) for a BF16 model on the CPU, else nothing."""
        return _Bf16InFp32(matmuls=True) if self._on_cpu_bf16(model) else contextlib.nullcontext()

    def _generation_products(self, model):
        """_Bf16InFp32 (convolutions only) for a BF16 model with a Conv1d on the CPU, else nothing."""
        has_conv = getattr(model, "_splicer_has_conv1d", None)
        if has_conv is None:  # asked once per model: generation calls this per prompt, timing per run
            modules = getattr(model, "modules", None)
            has_conv = callable(modules) and any(isinstance(m, torch.nn.Conv1d) for m in modules())
            with contextlib.suppress(AttributeError, TypeError):
                model._splicer_has_conv1d = has_conv
        return _Bf16InFp32(matmuls=False) if has_conv and self._on_cpu_bf16(model) else contextlib.nullcontext()

    def score(self, sequences, top_k=20, gather_ids=None, want_full=False, batch_size=4) -> Iterator[SequenceScores]:
        """Yields one SequenceScores per input sequence, in input order.

        Sequences of equal length are batched (no padding: the GDN layers take no attention mask).
        """
        model = self._need()
        results: dict[int, SequenceScores] = {}
        next_out = 0
        by_length = defaultdict(list)
        for i, seq in enumerate(sequences):
            by_length[len(seq)].append(i)
        batches = sorted(
            (idxs[s : s + batch_size] for idxs in by_length.values() for s in range(0, len(idxs), batch_size)), key=lambda b: b[0]
        )
        for batch in batches:
            # Inference mode only around the forward pass, never across a yield: a generator suspended inside the
            # block would leave the caller's thread in inference mode (no autograd) until it is exhausted or closed.
            with torch.inference_mode(), self._scoring_products(model):
                ids = torch.tensor([sequences[i] for i in batch], dtype=torch.long, device=self.device)
                logits = model(input_ids=ids, use_cache=False).logits.float()
                lps = torch.log_softmax(logits[:, :-1], dim=-1)
                for row, i in enumerate(batch):
                    lp = lps[row]
                    target = ids[row, 1:]
                    top = lp.topk(top_k, dim=-1)
                    gathered = None
                    if gather_ids is not None:
                        gathered = lp.gather(1, gather_ids[i].to(self.device).long()).cpu()
                    results[i] = SequenceScores(
                        topk_ids=top.indices.int().cpu(),
                        topk_logprobs=top.values.cpu(),
                        target_logprobs=lp.gather(1, target[:, None])[:, 0].cpu(),
                        gathered=gathered,
                        full=lp.cpu() if want_full else None,
                    )
            while next_out in results:  # every index lands in some batch, so this drains all of them
                yield results.pop(next_out)
                next_out += 1

    # ------------------------------------------------------------ generation
    def generate(self, prompts, max_new_tokens, stop_ids) -> list[list[int]]:
        model = self._need()
        outs = []
        with torch.inference_mode(), self._generation_products(model):
            for prompt in prompts:
                ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
                gen = model.generate(
                    input_ids=ids,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    eos_token_id=list(stop_ids) or None,
                    pad_token_id=(stop_ids or [0])[0],
                )
                outs.append(gen[0, len(prompt) :].tolist())
        return outs

    # ------------------------------------------------------------ timing
    def time_decode(self, prompt, new_tokens, warmup, runs) -> dict | None:
        """Batch-1 decode ms/token = (t(prompt + n tokens) - t(prompt + 1 token)) / (n - 1), and TTFT = t(1)."""
        model = self._need()
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)

        def run(n):
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.inference_mode(), self._generation_products(model):
                model.generate(input_ids=ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - t0

        for _ in range(warmup):
            run(new_tokens)
        per_token, ttft = [], []
        for _ in range(runs):
            t1 = run(1)
            tn = run(new_tokens)
            ttft.append(t1 * 1000)
            per_token.append((tn - t1) * 1000 / (new_tokens - 1))
        return {
            **decode_summary(per_token),
            "ttft_ms": statistics.median(ttft),
            "ttft_min_max": [min(ttft), max(ttft)],
            "runs": runs,
            "warmup": warmup,
            "prompt_tokens": len(prompt),
            "new_tokens": new_tokens,
            "method": "wall: (t(n) - t(1)) / (n - 1), wall clock around generate, batch 1",
        }

    def describe(self) -> dict:
        import transformers

        dev = str(self.device)
        if self.device.type == "cuda":
            dev = torch.cuda.get_device_name(self.device)
        return {
            "backend": "torch",
            "engine": f"transformers {transformers.__version__}",
            "torch": torch.__version__,
            "device": dev,
            "dtype": str(self.dtype).replace("torch.", ""),
            "threads": torch.get_num_threads(),
            "scoring_products": self.SCORING_PRODUCTS,
            "model_dtype": self.MODEL_DTYPE,
        }

    # ------------------------------------------------------------ MTP drafter, teacher-forced
    drafter = None  # the loaded checkpoint's MTP head, once load_drafter() built it

    @staticmethod
    def check_drafter(ckpt) -> None:
        """Refuse, in one line, a checkpoint whose family's MTP drafter this backend does not run (before a run starts)."""
        from .torch_mtp import drafter_class

        drafter_class(ckpt.arch)

    def load_drafter(self) -> None:
        """The loaded checkpoint's MTP head (torch_mtp.py, the module its family's table names), filled with its MTP
        tensors, quantized modules dequantized as the trunk's are."""
        from ..splice.modules import list_modules
        from .torch_mtp import drafter_class

        model = self._need()
        ckpt = open_checkpoint(self.folder, "checkpoint")
        arch = ckpt.arch
        kind = drafter_class(arch)
        names = [n for n in ckpt.weight_map if arch.is_mtp(n)]
        if not names:
            raise SplicerError(
                f"{self.folder}: no MTP tensors ({arch.mtp_prefix}*); give the checkpoint its head "
                "(splicer splice --restore mtp BUILD BASE -o NEW) or leave this row out"
            )
        drafter = self._unfilled(lambda: kind(model.config))
        raw = _read_tensors(ckpt, names)
        if ckpt.quantization_config:
            modules = {n: m for n, m in list_modules(ckpt).items() if arch.is_mtp(n)}
            raw = self._dequantize(raw, self._module_schemes(ckpt, modules))
        params = dict(drafter.state_dict(keep_vars=True))
        local = {name[len(arch.mtp_prefix) :]: t for name, t in self._to_model_names(raw, arch).items()}
        filled = _fill(params, local, self.folder, f"{arch.name}'s MTP drafter ({arch.mtp_drafter})", arch.mtp_prefix)
        _require(
            set(dict(drafter.named_parameters())), filled, self.folder, arch.mtp_prefix, "the checkpoint's MTP head is incomplete"
        )
        drafter.eval()
        self.drafter = drafter

    def draft_hits(self, sequences, batch_size: int = 4) -> list[torch.Tensor]:
        """Per sequence x_0 .. x_{T-1}, a bool tensor over t = 0 .. T-3: whether the MTP head's argmax given (h_t,
        x_{t+1}) equals the trunk's own argmax at t+1 (the token the model puts at t+2 after the true prefix), i.e.
        whether its first draft token would be accepted under greedy verification, teacher-forced on the sequence."""
        from .torch_mtp import draft_logits

        model = self._need()
        if self.drafter is None:
            raise RuntimeError("load_drafter() after load() first")
        out: list[torch.Tensor] = [torch.zeros(0, dtype=torch.bool)] * len(sequences)
        by_length = defaultdict(list)
        for i, seq in enumerate(sequences):
            if len(seq) >= 3:
                by_length[len(seq)].append(i)
        for length, idxs in sorted(by_length.items()):
            for s in range(0, len(idxs), batch_size):
                batch = idxs[s : s + batch_size]
                with torch.inference_mode(), self._scoring_products(model):
                    ids = torch.tensor([sequences[i] for i in batch], dtype=torch.long, device=self.device)
                    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
                    target = model.lm_head(hidden[:, 1 : length - 1]).argmax(-1)
                    draft = draft_logits(
                        self.drafter, model.model, model.lm_head, hidden[:, : length - 2], ids[:, 1 : length - 1]
                    )
                    hits = (draft.argmax(-1) == target).cpu()
                for row, i in enumerate(batch):
                    out[i] = hits[row]
        return out


@dataclass(frozen=True)
class TorchOptions:
    """The torch backend's options (backends.BackendOptions): its CPU threads (--threads; None: choose_threads picks)."""

    threads: int | None = None
    ray: str | None = None  # --ray [ADDRESS]: rows on a Ray cluster's lanes (ray_lanes.py)
    ray_lanes: int | None = None  # at most this many lanes

    backend = "torch"
    gpus = ()  # one device per run, or one per Ray lane

    def __post_init__(self):
        from . import ray_lanes

        ray_lanes.check_options(self.ray, self.ray_lanes)

    def speculative(self) -> None:
        return None  # transformers' model of the family has no MTP head: no speculative decoding here

    def tasks(self) -> TorchOptions:
        return self  # lm-eval's HF model over this backend's model, as the rows were scored

    @classmethod
    def option_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    @classmethod
    def refused_elsewhere(cls, given: dict) -> str:
        return "--threads sets the torch backend's CPU threads; vLLM's engine processes take their share of the cores themselves"

    @classmethod
    def from_job(cls, settings: dict) -> TorchOptions:
        # the thread count changes no measurement: a job does not record it; a run on Ray lanes is extended on Ray
        # lanes (budget --verify), where ray.init's own choice finds the cluster (e.g. RAY_ADDRESS)
        return cls(ray="default" if settings.get("ray") else None)

    @classmethod
    def backend_type(cls) -> type:
        return TorchBackend

    def check_device(self, device: str) -> None:
        pass  # pick_device refuses a device the backend cannot run on, when it starts

    def job_settings(self) -> dict:
        # The keys a job of this backend recorded before options were the backend's own, and how its scoring passes
        # compute their products: a job scored with torch's BF16 GEMM on the CPU (before scoring_products was recorded)
        # is another job, as its base pass is another cache (cache_key); so is one whose models were built in their
        # config's dtype (model_dtype). Rows on Ray lanes are named and compared per lane: another job.
        return {
            "engine_args": {},
            "overlap_starts": 0,
            "rewake_before_timing": False,
            "scoring_products": TorchBackend.SCORING_PRODUCTS,
            "model_dtype": TorchBackend.MODEL_DTYPE,
            **({"ray": True} if self.ray else {}),
        }

    def cache_key(self) -> list:
        return [{"scoring_products": TorchBackend.SCORING_PRODUCTS, "model_dtype": TorchBackend.MODEL_DTYPE}]

    def context_length(self) -> int | None:
        return None

    def ray_engine(self, device: str, cluster_has_gpus: bool) -> tuple[str, int]:
        # one GPU per lane where the device is CUDA (auto: where the cluster has GPUs), else one core and no GPU
        on_gpu = device.startswith("cuda") or (device == "auto" and cluster_has_gpus)
        return ("cuda", 1) if on_gpu else ("cpu", 0)

    def check_loadable(self, ckpt, modules: dict | None = None) -> None:
        if ckpt.quantization_config:  # the build and checkpoint rows are loaded as stored: refused now, not as a failed row
            TorchBackend.check_readable(ckpt, modules)

    def make_backends(self, device: str, log_dir: Path) -> list:
        if self.ray:  # one lane per GPU of the cluster (per core, on the CPU), each a backend of these options but --ray
            from dataclasses import replace

            from . import ray_lanes

            return ray_lanes.make_lanes(replace(self, ray=None, ray_lanes=None), device, log_dir, self.ray, self.ray_lanes)
        return [TorchBackend(device=device, threads=self.threads)]
