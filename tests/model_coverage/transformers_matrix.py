"""Coverage matrix: every experts-interface MoE model type of the installed transformers,
streamed through `strata_stream.transformers.load` vs plain transformers.

Discovery (no hand list): every model type of transformers' config table whose model package
uses ``use_experts_implementation`` (in its own modeling file, or a model package it imports
from) is a candidate; each candidate's causal LM is built tiny from its own config class (the
class `strata_stream.transformers.loader.causal_lm_class` resolves, as the library does), and
the types whose built model holds an experts-interface module (`families.is_experts_module`) are
the rows. A candidate that fails to build tiny, or has no causal LM, stays a row saying why.

Per type, in a subprocess with a timeout: a tiny random float32 checkpoint (`TINY`, keyed by
config field name; transformers' own classes and save_pretrained), then plain transformers
(eager attention, eager experts) against the streamed model on the same directory, at an arena
of 2 * top_k + 1 expert records (well below the experts' size): teacher-forced logits within
the float32 tolerance of tests/test_transformers_families.py (1e-5 of max|logit|) and greedy
tokens. Results: ``exact``, ``mismatch (...)``, ``refused: <one line>``, ``crash: <type: msg>``,
``skip: <reason>``.

    python -m tests.model_coverage.transformers_matrix [--types a,b] [--shard i/n] [--json OUT]
                                                 [--write-docs docs/models.md]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HIDDEN, INTER, EXPERTS, TOP_K, LAYERS = 64, 24, 8, 2, 3
# Tiny values by config field name, applied wherever a config class has the field (in its
# defaults), and to its text_config likewise. One dict for every type.
TINY: dict[str, Any] = {
    # widths and depth (2 * moe_intermediate != hidden: the two fused orientations differ)
    "hidden_size": HIDDEN,
    "text_hidden_size": HIDDEN,  # a vision tower's output width, fed to the text model
    "intermediate_size": 96,
    "moe_intermediate_size": INTER,
    "expert_intermediate_size": INTER,
    "moe_ffn_hidden_size": INTER,
    "shared_expert_intermediate_size": 48,
    "moe_shared_expert_intermediate_size": 48,
    "dense_intermediate_size": 96,
    "num_hidden_layers": LAYERS,
    "num_layers": LAYERS,
    "vocab_size": 64,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    # attention
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    # Multi-head latent attention (DeepSeek-style): head_dim is derived from these (_tiny).
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 32,
    "sliding_window": 8,
    "index_head_dim": 32,
    "index_n_heads": 2,
    "index_topk": 16,
    # linear attention / state-space layers
    "linear_num_value_heads": 2,
    "linear_num_key_heads": 1,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "mamba_n_heads": 2,
    "mamba_d_head": 64,  # heads x head width = the Mamba mixer's 2 x hidden_size
    "mamba_head_dim": 64,
    "mamba_d_state": 8,
    "ssm_state_size": 8,
    "n_groups": 1,
    "attn_layer_period": 2,  # Jamba-style period/offset layouts: attention in a 3-layer model
    "attn_layer_offset": 1,
    "mamba_n_groups": 1,
    # experts and routing
    "num_experts": EXPERTS,
    "num_local_experts": EXPERTS,
    "n_routed_experts": EXPERTS,
    "moe_num_experts": EXPERTS,
    "num_experts_per_tok": TOP_K,
    "top_k_experts": TOP_K,
    "enable_moe_block": True,
    "moe_topk": TOP_K,
    "moe_k": TOP_K,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    # ids
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 0,
}
# Set where the tiny config fails to build without them (a field with no default).
FALLBACK: dict[str, Any] = {"layer_types": ["full_attention"] * LAYERS}
# The float32 tolerance of tests/test_transformers_families.py: the same equations, accumulated
# in another order.
TOLERANCE = 1e-5
PROMPT = [5, 9, 12, 3, 40, 22, 7, 8, 9, 10, 33, 2, 17, 61, 4, 4, 30, 12, 50, 6]
NEW_TOKENS = 8
REGION = "matrix:transformers"


def _transformers_dir() -> Path:
    import transformers

    return Path(transformers.__file__).parent / "models"


def _uses_experts_interface(package: str, seen: frozenset[str] = frozenset()) -> bool:
    """Whether a model package's modeling files use the experts interface, or import from a
    model package that does."""
    root = _transformers_dir() / package
    text = "".join(p.read_text(errors="replace") for p in sorted(root.glob("modeling_*.py")))
    if "use_experts_implementation" in text:
        return True
    for other in sorted(set(re.findall(r"from \.\.(\w+)\.modeling_", text)) - seen - {package}):
        if _uses_experts_interface(other, seen | {package}):
            return True
    return False


def candidates() -> list[str]:
    """Every model type whose model package uses the experts interface (source only)."""
    from transformers.models.auto.configuration_auto import (
        CONFIG_MAPPING_NAMES,
        model_type_to_module_name,
    )

    out = []
    for model_type in sorted(CONFIG_MAPPING_NAMES):
        package = model_type_to_module_name(model_type)
        if (_transformers_dir() / package).is_dir() and _uses_experts_interface(package):
            out.append(model_type)
    return out


def _window(values: list[Any]) -> list[Any]:
    """LAYERS consecutive entries of a per-layer list, the first window with the most distinct
    values (so a pattern such as three linear-attention layers then a full one keeps both)."""
    windows = [values[i : i + LAYERS] for i in range(len(values) - LAYERS + 1)]
    return max(windows, key=lambda w: len({json.dumps(v) for v in w}))


def _tiny(config_class: Any, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """TINY's entries for the fields `config_class` has, and the per-layer lists of its
    defaults cut to LAYERS."""
    defaults = config_class().to_dict()
    kwargs = {k: v for k, v in TINY.items() if k in defaults}
    for k, v in kwargs.items():  # a per-layer (or per-modality) list of a scalar field: all v
        if isinstance(defaults[k], list) and not isinstance(v, list) and defaults[k]:
            kwargs[k] = [v] * len(defaults[k])
    if "qk_rope_head_dim" in defaults:  # latent attention derives head_dim from its split
        kwargs.pop("head_dim", None)
    n = defaults.get("num_hidden_layers")
    for k, v in defaults.items():
        if k not in kwargs and isinstance(v, list) and n and len(v) == n and n > LAYERS:
            kwargs[k] = _window(v)
    return {**kwargs, **(extra or {})}


def tiny_config(model_type: str, extra: dict[str, Any] | None = None) -> Any:
    """The tiny config of `model_type`, built by its own config class (`extra`: entries set
    whatever the defaults hold)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    kwargs = _tiny(config_class, extra)
    sub = getattr(config_class, "sub_configs", {}) or {}
    for name, sub_class in sub.items():  # text_config, vision_config, ...: tiny alike
        try:
            kwargs[name] = _tiny(sub_class, extra if name == "text_config" else None)
        except Exception:  # noqa: BLE001, S112 - a sub-config that needs arguments keeps its own
            continue
    return config_class(**kwargs)


def _randomize(model: Any, seed: int) -> None:
    """Random weights of order one (transformers' own init leaves a tiny model's logits flat);
    the same scaling as strata_stream.transformers.random_model."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if not p.is_floating_point() or "rotary" in name or "inv_freq" in name:
                continue
            v = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.ndim >= 2:
                v = v if "embed" in name else v / math.sqrt(p.shape[-1])
            elif "norm" in name:
                v = 1.0 + 0.1 * v
            else:
                v = 0.2 * v
            p.copy_(v.to(p.dtype))


def _one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return msg if len(msg) <= 300 else msg[:297] + "..."


@dataclass
class Row:
    model_type: str
    result: str  # exact | mismatch (...) | refused: ... | crash: ... | skip: ...
    seconds: float = 0.0
    prediction: str = ""  # "router 2/2" etc. where the streamed model loaded

    @property
    def exact(self) -> bool:
        return self.result == "exact"


def build_tiny(model_type: str, path: Path) -> tuple[Any, bool]:
    """A tiny random float32 checkpoint of `model_type` at `path`; returns (causal LM class,
    whether it holds experts-interface modules). Raises on a failed build."""
    import torch

    from strata_stream.errors import ConfigError
    from strata_stream.transformers.families import find_blocks
    from strata_stream.transformers.loader import causal_lm_class, config_for

    try:
        config = tiny_config(model_type)
        try:
            built: type[Any] | None = causal_lm_class(config)
        except ConfigError:
            built = None
        if built is not None:
            with torch.device("meta"):  # does it build? (structure only)
                built._from_config(config_for(built, config))
    except Exception as e:  # noqa: BLE001 - once more with the entries no default provides
        try:
            config = tiny_config(model_type, FALLBACK)
        except Exception:  # noqa: BLE001 - the first failure is the one to report
            raise e from None
    try:
        cls = causal_lm_class(config)
    except ConfigError:
        # Not a causal LM: a row only where its model holds experts-interface modules.
        from transformers import AutoModel

        try:
            with torch.device("meta"):  # structure only: no weights are made
                base = AutoModel.from_config(config)
        except ValueError:  # no model class of its own either (a sub-config)
            raise ConfigError(f"no causal LM or model class for {type(config).__name__}") from None
        if find_blocks(base):
            raise
        return type(base), False
    torch.manual_seed(0)
    model = cls._from_config(config_for(cls, config), dtype=torch.float32)
    if not find_blocks(model):
        return cls, False
    _randomize(model, 0)
    model.config.dtype = "float32"
    model.save_pretrained(str(path))
    return cls, True


def run_type_here(model_type: str, root: Path) -> Row:
    """One row, in this process."""
    import numpy as np
    import torch

    from strata_stream import ExpertPack, StreamConfig
    from strata_stream.convert import convert
    from strata_stream.errors import ConfigError, PackError, StrataError
    from strata_stream.transformers import load

    start = time.monotonic()
    path = root / model_type

    def row(result: str, prediction: str = "") -> Row:
        return Row(model_type, result, round(time.monotonic() - start, 1), prediction)

    try:
        cls, moe = build_tiny(model_type, path)
    except ConfigError as e:
        return row(f"skip: not a causal LM ({_one_line(e)})")
    except Exception as e:  # noqa: BLE001 - plain transformers itself fails
        return row(f"skip: plain transformers fails to build tiny ({type(e).__name__}: "
                   f"{_one_line(e)})")  # fmt: skip
    if not moe:
        return row("skip: the built causal LM holds no experts-interface module")

    def run(model: Any) -> tuple[Any, list[int]]:
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT])).logits[0].float().numpy()
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False)
        return logits, [int(t) for t in out[0, len(PROMPT) :]]

    try:
        ref_model = cls.from_pretrained(
            str(path), dtype=torch.float32, attn_implementation="eager",
            experts_implementation="eager",
        ).eval()  # fmt: skip
        ref = run(ref_model)
        del ref_model
    except Exception as e:  # noqa: BLE001
        return row(f"skip: plain transformers fails to run tiny ({type(e).__name__}: "
                   f"{_one_line(e)})")  # fmt: skip
    config = StreamConfig(io_threads=2, direct_io=False, persist_profile=False)
    model = None
    try:
        pack = root / f"{model_type}.strpk"
        try:
            convert(path, pack, progress=False)
        except (ConfigError, PackError):
            # What load says first: its own refusal of the model, else the converter's.
            load(path, pack_path=pack, config=config, progress=False)
            raise
        with ExpertPack.open(pack) as p:
            arena = (2 * p.geometry.top_k + 1) * p.record_stride
        model = load(
            path, pack_path=pack, arena_bytes=arena, config=config, dtype=torch.float32,
            attn_implementation="eager", progress=False,
        )  # fmt: skip
        engine = model.strata_engine
        prediction = f"router {engine.prediction.count('router')}/{len(engine.prediction)}"
        got = run(model)
    except (ConfigError, PackError) as e:  # the temporary directory's name says nothing
        return row(f"refused: {_one_line(e).replace(str(path), '<checkpoint>')}")
    except StrataError as e:
        return row(f"crash: {type(e).__name__}: {_one_line(e)}")
    except Exception as e:  # noqa: BLE001
        return row(f"crash: {type(e).__name__}: {_one_line(e)}")
    finally:
        if model is not None:
            model.strata_engine.close()
    ref_logits, ref_tokens = ref
    got_logits, got_tokens = got
    scale = float(np.abs(ref_logits).max())
    diff = float(np.abs(got_logits - ref_logits).max())
    if not np.isfinite(diff) or diff > TOLERANCE * scale:
        return row(f"mismatch (logits: max|diff| {diff:.3g} of max|logit| {scale:.3g})",
                   prediction)  # fmt: skip
    if got_tokens != ref_tokens:
        return row(f"mismatch (greedy tokens {got_tokens} vs {ref_tokens})", prediction)
    return row("exact", prediction)


def run_type(model_type: str, timeout: float) -> Row:
    """One row, in a subprocess with a timeout."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"tfm-{model_type}-") as tmp:
        out = Path(tmp) / "row.json"
        argv = [sys.executable, "-m", "tests.model_coverage.transformers_matrix", "--child",
                model_type, "--json", str(out), "--workdir", tmp]  # fmt: skip
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
        try:
            proc = subprocess.run(
                argv, capture_output=True, text=True, timeout=timeout, env=env,
                cwd=Path(__file__).resolve().parents[2],
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return Row(model_type, f"crash: timeout after {timeout:.0f} s", round(timeout, 1))
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            why = _one_line(Exception(tail))
            return Row(model_type, f"crash: child exited {proc.returncode}: {why}",
                       round(time.monotonic() - start, 1))  # fmt: skip
        data = json.loads(out.read_text())
        return Row(**data)


def closing_line(rows: list[Row]) -> str:
    """`transformers X.Y.Z: N of M MoE model types stream exactly` (M: every row, skipped ones
    included, as the mlx-lm matrix counts), then how many of those that build and run tiny in
    plain transformers as causal LMs stream exactly."""
    import transformers

    ran = [r for r in rows if not r.result.startswith("skip")]
    exact = sum(r.exact for r in rows)
    return (
        f"transformers {transformers.__version__}: {exact} of {len(rows)} MoE model types stream "
        f"exactly ({exact} of the {len(ran)} that build and run tiny as causal LMs in plain "
        "transformers)"
    )


def table(rows: list[Row]) -> str:
    import transformers

    lines = [
        f"transformers {transformers.__version__}, generated by `python -m "
        "tests.model_coverage.transformers_matrix --write-docs docs/models.md`: every model type "
        "whose model uses transformers' experts interface, a tiny random float32 checkpoint "
        "streamed at an arena of 2 x top-k + 1 expert records against plain transformers "
        "(teacher-forced "
        f"logits within {TOLERANCE:g} of max|logit|, {NEW_TOKENS} greedy tokens).",
        "",
        "| model type | result |",
        "|---|---|",
    ]
    for r in rows:
        cell = r.result.replace("|", "/").replace("<", "&lt;").replace(">", "&gt;")
        lines.append(f"| {r.model_type} | {cell} |")
    lines += ["", closing_line(rows)]
    return "\n".join(lines)


def write_docs(path: Path, rows: list[Row]) -> None:
    """Replace the region between the matrix:transformers markers of `path` with the table."""
    text = path.read_text()
    begin, end = f"<!-- {REGION} -->", f"<!-- /{REGION} -->"
    if begin not in text or end not in text:
        raise SystemExit(f"{path}: no {begin} ... {end} region")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{table(rows)}\n{end}{tail}")


def _line(row: Row) -> str:
    """One printed row: the result, the prediction where the streamed model loaded, the time."""
    pred = f" [prediction: {row.prediction}]" if row.prediction else ""
    return f"{row.model_type}: {row.result}{pred} ({row.seconds:.0f} s)"


def _is_moe_row(row: Row) -> bool:
    """Rows of MoE model types: not the candidates whose built model holds no experts module,
    nor the sub-configs (a vision or audio encoder's) that have no model class of their own."""
    return not row.result.startswith(
        ("skip: the built causal LM holds no experts-interface module",
         "skip: not a causal LM (no causal LM or model class for")
    )  # fmt: skip


def shard_of(items: list[str], shard: str) -> list[str]:
    i, n = (int(v) for v in shard.split("/"))
    if not 0 <= i < n:
        raise SystemExit(f"--shard {shard}: i must be in 0..n-1")
    return items[i::n]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.model_coverage.transformers_matrix",
        description="Stream every experts-interface MoE model type of the installed "
        "transformers and compare with plain transformers.",
    )
    parser.add_argument("--types", help="comma-separated model types (default: every candidate)")
    parser.add_argument("--shard", help="i/n: every n-th type from the i-th (0-based)")
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    parser.add_argument("--write-docs", type=Path, help="regenerate the matrix region of this file")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per model type")
    parser.add_argument("--jobs", type=int, default=1, help="model types run at once")
    parser.add_argument("--rows", type=Path, help="render the rows of an earlier --json run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        import resource

        # A tiny model needs little memory; a config that stays huge must not take the machine.
        limit = int(float(os.environ.get("STRATA_MATRIX_MEMORY_GB", "8")) * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        row = run_type_here(args.child, args.workdir or Path(tempfile.mkdtemp()))
        if args.json:
            args.json.write_text(json.dumps(asdict(row)))
        return 0
    if args.rows:
        rows = [Row(**r) for r in json.loads(args.rows.read_text())]
        for r in rows:
            print(_line(r))
        print(closing_line([r for r in rows if _is_moe_row(r)]))
        if args.write_docs:
            write_docs(args.write_docs, [r for r in rows if _is_moe_row(r)])
        return 0
    types = args.types.split(",") if args.types else candidates()
    if args.shard:
        types = shard_of(types, args.shard)
    start = time.monotonic()
    rows: list[Row] = []
    if args.jobs > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(args.jobs) as pool:
            for r in pool.map(lambda t: run_type(t, args.timeout), types):
                print(_line(r), flush=True)
                rows.append(r)
    else:
        for t in types:
            r = run_type(t, args.timeout)
            print(_line(r), flush=True)
            rows.append(r)
    rows = [r for r in rows if _is_moe_row(r)]
    print(f"({len(types)} candidate types in {time.monotonic() - start:.0f} s)")
    print(closing_line(rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    if args.write_docs:
        write_docs(args.write_docs, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
