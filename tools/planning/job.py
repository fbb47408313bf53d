"""The job a user asks the planner about (tools/plan.py): sites, links, model, tokens, layout.

A job comes from flags or from a TOML file in the leaderboard's scenario format
(tools/benchmarks/scenarios/, read by megatron_lsgd.training.scenario), extended by two
tables the simulated clock does not read:

    [model]                      # a Megatron shape, or params = 7e9
    num_layers = 32
    hidden_size = 4096
    num_attention_heads = 32
    num_query_groups = 8         # default: num_attention_heads
    ffn_hidden_size = 14336      # default: 4 x hidden (8/3 x hidden with swiglu)
    vocab_size = 32000
    swiglu = true
    untie_embeddings = true
    [job]
    tokens_per_step = 4194304    # the whole job's, every site together
    total_tokens = 2e12
    seq_length = 4096
    micro_batch_size = 1
    tensor_parallel = 8          # one for every site, or one per site: [8, 4]
    pipeline_parallel = 1        # likewise
    recompute = "selective"      # none, selective or full

A leaderboard scenario file is a job as it stands: its target_params is the model and
sites x tokens_per_microbatch the tokens per step. What the clock needs is written back as a
plain scenario file (`scenario_toml`), so the planner's pilots and the board's read the same
kind of file through the same loader.

Sites of different TP x PP (docs/heterogeneous_sites.md) keep one replica's share of a step
everywhere, so a site whose replicas are fewer GPUs computes its share more slowly: the
scenario carries that as the site's compute factor (`layout_factors`; the clock applies a
site's factor to its optimizer step too, a small part of a step). The pilots themselves train
the stand-in on one rank per site, as for any job: the clock charges the bytes as the target
model's, which cross sites once per site whatever the layout (the layout-free exchange).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Union

MODEL_KEYS = {"params", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
              "vocab_size", "swiglu", "untie_embeddings"}
JOB_KEYS = {"tokens_per_step", "total_tokens", "seq_length", "micro_batch_size", "tensor_parallel",
            "pipeline_parallel", "recompute"}
RECOMPUTE = ("none", "selective", "full")
DEFAULT_SEQ = 4096


@dataclass
class Model:
    """A GPT's shape (Llama-style when swiglu), or only its parameter count."""
    params: Optional[float] = None
    num_layers: Optional[int] = None
    hidden_size: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_query_groups: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    vocab_size: int = 32000
    swiglu: bool = True
    untie_embeddings: bool = True

    @property
    def has_shape(self) -> bool:
        return self.num_layers is not None and self.hidden_size is not None

    def parameter_count(self) -> float:
        """Given, or counted from the shape: attention (q, k, v, output), the MLP, two norms
        per layer, the final norm, the word embedding and, untied, the output layer."""
        if not self.has_shape:
            return float(self.params)
        h, layers = self.hidden_size, self.num_layers
        heads = self.num_attention_heads or max(1, h // 128)
        groups = self.num_query_groups or heads
        kv = h // heads * groups
        ffn = self.ffn_hidden_size or (int(8 * h / 3) if self.swiglu else 4 * h)
        attention = h * (h + 2 * kv) + h * h
        mlp = (3 if self.swiglu else 2) * h * ffn
        per_layer = attention + mlp + 2 * h
        embeddings = self.vocab_size * h * (2 if self.untie_embeddings else 1)
        return float(layers * per_layer + h + embeddings)

    def layers_for_memory(self) -> int:
        """Layers, or a guess from the count (a Llama-like aspect: hidden ~ 128 x layers)."""
        if self.num_layers:
            return self.num_layers
        return max(2, round((self.params / (12 * 128 ** 2)) ** (1 / 3)))

    def hidden_for_memory(self) -> int:
        return self.hidden_size or 128 * self.layers_for_memory()


@dataclass
class Job:
    sites: int
    gpus_per_site: List[int]
    rate_mbit: List[float]
    latency_ms: List[float]
    site_factors: List[float]
    model: Model
    tokens_per_step: float
    total_tokens: float
    sustained_tflops: Optional[float] = None  # per GPU; or
    step_seconds: Optional[float] = None      # a measured compute time of one step (every site alike)
    hbm_gbyte_s: float = 3000.0
    intra_site_gbit: float = 3200.0
    gpu_memory_gb: float = 80.0
    seq_length: int = DEFAULT_SEQ
    micro_batch_size: int = 1
    tensor_parallel: Union[int, List[int]] = 1  # one for every site, or one per site (validate: a list)
    pipeline_parallel: Union[int, List[int]] = 1
    recompute: str = "selective"
    description: str = ""
    source: str = "flags"
    notes: List[str] = field(default_factory=list)

    @property
    def params(self) -> float:
        return self.model.parameter_count()

    @property
    def steps(self) -> int:
        return max(1, math.ceil(self.total_tokens / self.tokens_per_step))

    def tp(self, site: int = 0) -> int:
        return _at(self.tensor_parallel, site)

    def pp(self, site: int = 0) -> int:
        return _at(self.pipeline_parallel, site)

    def model_parallel(self, site: int = 0) -> int:
        """GPUs of one replica of the model on `site`."""
        return self.tp(site) * self.pp(site)

    def dp_intra(self, site: int = 0) -> int:
        return self.gpus_per_site[site] // self.model_parallel(site)

    @property
    def unequal(self) -> bool:
        """Sites of different data-parallel sizes (--site-data-parallel-sizes,
        docs/heterogeneous_sites.md)."""
        return len({self.dp_intra(s) for s in range(self.sites)}) > 1

    @property
    def mixed_layouts(self) -> bool:
        """Sites of different TP x PP (--site-tensor/pipeline-model-parallel-sizes)."""
        return len({(self.tp(s), self.pp(s)) for s in range(self.sites)}) > 1

    @property
    def smallest_site(self) -> int:
        """The site with the fewest GPUs: its GPUs hold the largest ZeRO-1 shards of the
        optimizer and take the longest optimizer step (the lockstep's pace)."""
        return min(range(self.sites), key=lambda s: self.gpus_per_site[s])

    def layout_factors(self) -> List[float]:
        """Each site's compute per step against the scenario's (the smallest site's share of a
        step over its GPUs, the same on every site of one layout): a replica computes the job's
        tokens / replicas on TP x PP GPUs, so site s takes GPUs / (replicas x TP_s x PP_s) of
        it. 1 for every site of one layout, whatever their sizes."""
        if not self.mixed_layouts:
            return [1.0] * self.sites
        replicas = sum(self.dp_intra(s) for s in range(self.sites))
        return [sum(self.gpus_per_site) / (replicas * self.model_parallel(s)) for s in range(self.sites)]

    def microbatches(self) -> int:
        """Micro-batches per replica per step: every replica of every site computes the same
        number, so a site's share of the batch follows its data-parallel size."""
        replicas = sum(self.dp_intra(s) for s in range(self.sites))
        return max(1, round(self.tokens_per_step / self.seq_length / self.micro_batch_size / replicas))

    def validate(self) -> None:
        """Each error names the flag or key (the TOML keys have the flags' names)."""
        where = self.source
        if self.sites < 2:
            raise ValueError(f"{where}: sites = {self.sites}: the planner compares cross-site algorithms, give >= 2")
        for name, values in (("--gpus-per-site", self.gpus_per_site), ("--rate-mbit", self.rate_mbit),
                             ("--latency-ms", self.latency_ms), ("--site-factors", self.site_factors)):
            if len(values) != self.sites:
                raise ValueError(f"{where}: {name} has {len(values)} values for {self.sites} sites")
        if any(g < 1 for g in self.gpus_per_site):
            raise ValueError(f"{where}: --gpus-per-site {self.gpus_per_site}: every site needs >= 1 GPU")
        if any(r <= 0 for r in self.rate_mbit):
            raise ValueError(f"{where}: --rate-mbit {self.rate_mbit}: every link needs a rate > 0")
        if any(f <= 0 for f in self.site_factors):
            raise ValueError(f"{where}: --site-factors {self.site_factors}: slowdowns must be > 0 (1 = nominal)")
        for name, flag in (("tensor_parallel", "--tensor-parallel"), ("pipeline_parallel", "--pipeline-parallel")):
            setattr(self, name, _per_site_ints(getattr(self, name), self.sites, f"{where}: {flag}"))
        if self.model.params is None and not self.model.has_shape:
            raise ValueError(f"{where}: give the model: --params, or --num-layers and --hidden-size")
        if self.params <= 0:
            raise ValueError(f"{where}: --params {self.model.params}: must be > 0")
        if (self.sustained_tflops is None) == (self.step_seconds is None):
            raise ValueError(f"{where}: give exactly one of --sustained-tflops (per GPU, achieved) and "
                             f"--step-seconds (a measured compute time of one step)")
        for name, value in (("--tokens-per-step", self.tokens_per_step), ("--total-tokens", self.total_tokens),
                            ("--sustained-tflops", self.sustained_tflops), ("--step-seconds", self.step_seconds),
                            ("--gpu-memory-gb", self.gpu_memory_gb)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{where}: {name} {value}: must be a finite number > 0")
        if self.total_tokens < self.tokens_per_step:
            raise ValueError(f"{where}: --total-tokens {self.total_tokens:g} is less than one step's "
                             f"--tokens-per-step {self.tokens_per_step:g}")
        for s in range(self.sites):
            if self.gpus_per_site[s] % self.model_parallel(s):
                raise ValueError(f"{where}: --gpus-per-site {self.gpus_per_site[s]} is not a multiple of "
                                 f"--tensor-parallel x --pipeline-parallel = {self.model_parallel(s)}"
                                 + (f" (site {s})" if self.mixed_layouts else ""))
        replicas = sum(self.dp_intra(s) for s in range(self.sites))
        per_site = self.tokens_per_step * min(self.dp_intra(s) for s in range(self.sites)) / replicas
        if per_site < self.seq_length * self.micro_batch_size:
            raise ValueError(f"{where}: --tokens-per-step {self.tokens_per_step:g} gives the smallest site "
                             f"{per_site:g} tokens, less than one micro-batch (--seq-length x --micro-batch-size)")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"{where}: --recompute {self.recompute!r}: choose one of {', '.join(RECOMPUTE)}")
        unit = self.seq_length * self.micro_batch_size * replicas  # one micro-batch on every replica
        if self.tokens_per_step % unit:
            lower = max(unit, self.tokens_per_step // unit * unit)
            raise ValueError(f"{where}: --tokens-per-step {self.tokens_per_step:g} does not divide into {replicas} "
                             f"data-parallel replicas x --micro-batch-size {self.micro_batch_size} x --seq-length "
                             f"{self.seq_length} (pretrain_gpt.py would refuse its global batch): give a multiple of "
                             f"{unit:g}, e.g. {lower:g} or {lower + unit:g}")
        for pp in sorted(set(self.pipeline_parallel)):
            if self.model.num_layers and self.model.num_layers % pp:
                raise ValueError(f"{where}: --num-layers {self.model.num_layers} is not a multiple of "
                                 f"--pipeline-parallel {pp}")

    def scenario_toml(self) -> str:
        """The simulated clock's scenario for this job (the leaderboard's format): one trained
        micro-batch per site per step stands for the site's share of a step's tokens. Sites of
        different sizes take shares that follow their sizes, so each site's compute per step
        is the same (its tokens / its GPUs); the scenario is written for the smallest site,
        whose optimizer step (the largest shard) is the slowest and so sets the lockstep. Sites of
        different layouts: each site's factor times its `layout_factors`."""
        small = self.gpus_per_site[self.smallest_site]
        lines = [f"# written by tools/plan.py for: {self.description or 'the job on its command line'}",
                 f"description = {json.dumps(self.description or 'planned job')}", f"sites = {self.sites}", "",
                 "[compute]"]
        if self.step_seconds is not None:
            lines += [f"microbatch_seconds = {self.step_seconds!r}",
                      f"optimizer_step_seconds = {16 * self.params / small / (self.hbm_gbyte_s * 1e9)!r}"]
        else:
            lines += [f"target_params = {self.params!r}",
                      f"tokens_per_microbatch = {self.tokens_per_step * small / sum(self.gpus_per_site)!r}",
                      f"gpus_per_replica = {small}",
                      f"sustained_tflops = {self.sustained_tflops!r}",
                      f"hbm_gbyte_s = {self.hbm_gbyte_s!r}"]
        factors = [f * k for f, k in zip(self.site_factors, self.layout_factors())] if self.mixed_layouts \
            else self.site_factors
        lines += [f"intra_site_gbit = {self.intra_site_gbit!r}", f"site_factors = {factors!r}", "",
                  "[link]", f"rate_mbit = {self.rate_mbit!r}", f"latency_ms = {self.latency_ms!r}",
                  f"target_params = {self.params!r}"]
        return "\n".join(lines) + "\n"


def _at(value: Union[int, Sequence[int]], site: int) -> int:
    """A per-site setting's value on `site` (one value: every site's)."""
    return value if isinstance(value, int) else value[site if len(value) > 1 else 0]


def _per_site_ints(value, sites: int, name: str) -> List[int]:
    """One whole number >= 1 for every site, from one or one per site; `name` in errors."""
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if len(values) not in (1, sites):
        raise ValueError(f"{name} has {len(values)} values for {sites} sites")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} {value!r}: give a whole number >= 1 (one for all sites, or one per site)")
    return values * sites if len(values) == 1 else values


def _spread(values: List[float], sites: int) -> List[float]:
    """One value for every site, or one per site as given."""
    return list(values) * sites if len(values) == 1 else list(values)


def job_from_toml(path: str, overrides: Optional[Dict] = None) -> Job:
    """A job file (a leaderboard scenario, optionally with [model] and [job]); every error
    names the file and the key. `overrides`: values given as flags, which win."""
    from megatron_lsgd.training.scenario import COMPUTE_KEYS, LINK_KEYS, read_toml  # torch: imported when used

    data = read_toml(path, "--job")
    where = f"--job {path}"
    known = {"description", "sites", "compute", "link", "model", "job"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    tables = {name: data.get(name, {}) for name in ("compute", "link", "model", "job")}
    for name, keys in (("compute", COMPUTE_KEYS), ("link", LINK_KEYS), ("model", MODEL_KEYS), ("job", JOB_KEYS)):
        if not isinstance(tables[name], dict):
            raise ValueError(f"{where}: [{name}] must be a table")
        typos = sorted(set(tables[name]) - keys)
        if typos:
            raise ValueError(f"{where} [{name}]: unknown key(s) {', '.join(typos)} (known: {', '.join(sorted(keys))})")
    compute, link, model_t, job_t = tables["compute"], tables["link"], tables["model"], tables["job"]
    sites = data.get("sites")
    if not isinstance(sites, int) or isinstance(sites, bool):
        raise ValueError(f"{where}: sites = {sites!r} must be a whole number >= 2")

    def listed(table: dict, key: str, default) -> List[float]:
        value = table.get(key, default)
        values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"{where}: {key} = {value!r} must be a number or a list of numbers")
        return _spread([float(v) for v in values], sites)

    def number(table: dict, key: str, kind=float, default=None):
        value = table.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            raise ValueError(f"{where}: {key} = {value!r} must be a {'whole ' if kind is int else ''}number")
        return kind(value)

    def per_site_number(table: dict, key: str):
        """A whole number, or a list of them (one per site); checked by Job.validate."""
        value = table.get(key, 1)
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v):
                raise ValueError(f"{where}: {key} = {value!r} must be a whole number or a list of them")
        return [int(v) for v in value] if isinstance(value, list) else int(value)

    model = Model(params=number(model_t, "params") or number(compute, "target_params") or number(link, "target_params"),
                  num_layers=number(model_t, "num_layers", int), hidden_size=number(model_t, "hidden_size", int),
                  num_attention_heads=number(model_t, "num_attention_heads", int),
                  num_query_groups=number(model_t, "num_query_groups", int),
                  ffn_hidden_size=number(model_t, "ffn_hidden_size", int),
                  vocab_size=number(model_t, "vocab_size", int, 32000),
                  swiglu=bool(model_t.get("swiglu", True)), untie_embeddings=bool(model_t.get("untie_embeddings", True)))
    tokens_mb = number(compute, "tokens_per_microbatch")
    tokens_per_step = number(job_t, "tokens_per_step") or (tokens_mb * sites if tokens_mb else None)
    if tokens_per_step is None:
        raise ValueError(f"{where}: give [job] tokens_per_step (or [compute] tokens_per_microbatch)")
    seq = number(job_t, "seq_length", int, DEFAULT_SEQ)
    values = dict(
        sites=sites, gpus_per_site=[int(g) for g in listed(compute, "gpus_per_replica", 1)],
        rate_mbit=listed(link, "rate_mbit", 0.0), latency_ms=listed(link, "latency_ms", 0.0),
        site_factors=listed(compute, "site_factors", 1.0), model=model, tokens_per_step=tokens_per_step,
        total_tokens=number(job_t, "total_tokens") or 20 * model.parameter_count() if (model.params or model.has_shape)
        else 0.0,
        sustained_tflops=number(compute, "sustained_tflops"), step_seconds=number(compute, "microbatch_seconds"),
        hbm_gbyte_s=number(compute, "hbm_gbyte_s", float, 3000.0),
        intra_site_gbit=number(compute, "intra_site_gbit", float, 3200.0),
        seq_length=seq, micro_batch_size=number(job_t, "micro_batch_size", int, 1),
        tensor_parallel=per_site_number(job_t, "tensor_parallel"),
        pipeline_parallel=per_site_number(job_t, "pipeline_parallel"),
        recompute=str(job_t.get("recompute", "selective")), description=str(data.get("description", "")),
        source=where)
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    job = Job(**values)
    if "total_tokens" not in job_t and not (overrides or {}).get("total_tokens"):
        job.notes.append(f"total tokens not given: 20 tokens per parameter assumed ({job.total_tokens:.3g})")
    job.validate()
    return job
