"""Side-by-side peer benchmark: colibri against llama.cpp on the same weights, in one run.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python tools/bench/peer_llamacpp.py \\
        [--workdir /var/tmp/colibri-peer] [--shapes deepseek_v3 glm_moe_dsa] [--rounds 3]
        [--threads N]

Needs ``llama-cpp-python`` (``pip install llama-cpp-python``: its sdist builds llama.cpp from
source, 7-17 minutes on 2 cores); this tool builds nothing itself. Per shape it:

1. makes a seeded HF checkpoint with transformers (bf16, ~2.2B parameters: DeepSeek-V3 or
   GLM-5 layout, 64 routed experts x 5 MoE layers, ~0.4B active; weights random, the tokenizer
   the oracle tool's), once, under ``--workdir``;
2. converts it with ``coli convert`` (int4-g64, the default) and with the converter vendored in
   the llama-cpp-python sdist of the installed version (fetched with ``pip download`` and unpacked
   under ``--workdir``) to GGUF f16, then quantizes that to Q4_0 (``llama_model_quantize``);
3. times both engines interleaved, ``--rounds`` rounds: prefill of a 64- and a 512-token prompt
   (time to the first token) and greedy decode of ``--tokens`` tokens after a 64-token prompt.
   Both on every usable CPU (``--threads N``: both on N; 1 compares the kernels without the
   parallel part); llama.cpp with its default settings (where they abort, as the
   repacked weight buffers do for MLA models in Q4_0 on some CPUs, ``use_extra_bufts=False``:
   ``use_extra_bufts`` in the JSON) in a process of its own with ``OMP_WAIT_POLICY`` unset (its
   OpenMP default; this process sets ``PASSIVE`` for numba), colibri with its defaults (exact
   kernels) and, as a third engine reported beside, with the opt-in lossy ``--kernels
   fast-int8`` (``--no-lossy``: skip).

The last line printed is one JSON object: ``figure`` = our decode tok/s / llama.cpp Q4_0 decode
tok/s (the lower of the shapes' medians), ``prefill_ratio`` (64 and 512 tokens, per shape), both
engines' numbers, the kernel variant and the machine. Token ids are the same for both engines;
the text is noise (random weights), only speed is compared.

Shape legend: T tokens, H hidden, E routed experts, V vocabulary.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before numba starts (DESIGN.md section 4)

import argparse
import contextlib
import importlib.metadata
import json
import platform
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# Run as a script, this folder is on sys.path, and its kernels.py would shadow the `kernels`
# package that transformers (5.x) imports: the folder goes (nothing here is imported from it).
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import numpy as np  # noqa: E402

from tools.bench._args import positive  # noqa: E402

SHAPES = ("deepseek_v3", "glm_moe_dsa")
VOCAB = 32000  # embedding rows; the tokenizer has fewer, the rest are never produced by ids we feed

# ~2.2B parameters, ~0.4B active: 1 dense + 5 MoE layers of 64 experts (6 per token + 1 shared).
_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=2048,
    intermediate_size=5632,
    moe_intermediate_size=1024,
    num_hidden_layers=6,
    first_k_dense_replace=1,
    num_attention_heads=16,
    num_key_value_heads=16,
    n_shared_experts=1,
    n_routed_experts=64,
    num_experts_per_tok=6,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    q_lora_rank=512,
    kv_lora_rank=256,
    qk_rope_head_dim=64,
    qk_nope_head_dim=64,
    v_head_dim=64,
    hidden_act="silu",
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    attention_bias=False,
    n_group=1,
    topk_group=1,
    rms_norm_eps=1e-6,
    num_nextn_predict_layers=0,
)

# The small script that runs the vendored converter: our tokenizer's pre-tokenizer is not in its
# table of known hashes, so it is named "gpt-2" (byte-level BPE, which it is), and it lacks GLM's
# special tokens ([gMASK], <|observation|>), so GLM models take the plain GPT-2 vocabulary path.
_CONVERT_SHIM = """
import sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(1, sys.argv[1] + "/gguf-py")
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
base.TextModel._set_vocab_glm = base.TextModel._set_vocab_gpt2
sys.argv = [sys.argv[1] + "/convert_hf_to_gguf.py"] + sys.argv[2:]
import runpy
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _log(msg: str) -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------- checkpoint


def make_checkpoint(shape: str, out: Path, seed: int = 0) -> None:
    """The seeded HF checkpoint of ``shape`` (bf16 safetensors, config, tokenizer) in ``out``."""
    import torch

    sys.path.insert(0, str(ROOT / "tools"))
    import make_oracle as mo

    tok = mo.train_tokenizer()
    ids = mo.special_ids(tok)
    eos = [VOCAB - 1]  # a padding id: greedy decode on random weights runs its full length
    cfg: Any
    if shape == "deepseek_v3":
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        cfg = DeepseekV3Config(**_COMMON, bos_token_id=ids["<|endoftext|>"], eos_token_id=eos)
        cls: Any = DeepseekV3ForCausalLM
    elif shape == "glm_moe_dsa":
        from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

        n = _COMMON["num_hidden_layers"]
        cfg = GlmMoeDsaConfig(
            **_COMMON,
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=eos,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            mlp_layer_types=["dense"] + ["sparse"] * (n - 1),
            index_topk=256,
            index_head_dim=64,
            index_n_heads=8,
            indexer_types=["full" if i % 2 == 0 else "shared" for i in range(n)],
        )
        cls = GlmMoeDsaForCausalLM
    else:
        raise SystemExit(f"unknown shape {shape!r}; choose from {SHAPES}")
    torch.manual_seed(seed)
    with _default_dtype(torch.bfloat16):
        model = cls(cfg)
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size="1GB")
    d = json.loads((out / "config.json").read_text())
    d["scoring_func"] = "sigmoid"  # llama.cpp's converter reads these legacy keys
    d["topk_method"] = "noaux_tc"
    d["num_nextn_predict_layers"] = 0
    (out / "config.json").write_text(json.dumps(d, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": cfg.bos_token_id, "eos_token_id": eos}) + "\n"
    )
    for fname, text in mo.tokenizer_files(tok).items():
        (out / fname).write_text(text)
    n_params = sum(p.numel() for p in model.parameters())
    (out / ".complete").write_text(json.dumps({"parameters": n_params}) + "\n")


@contextlib.contextmanager
def _default_dtype(dtype: Any) -> Iterator[None]:
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


# ----------------------------------------------------------------------------- conversions


def llama_source(workdir: Path) -> Path:
    """vendor/llama.cpp of the installed llama-cpp-python's sdist (downloaded once)."""
    version = importlib.metadata.version("llama-cpp-python")
    src = workdir / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if (src / "convert_hf_to_gguf.py").exists():
        return src
    _log(f"fetching the llama-cpp-python {version} sdist for its converter")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
         f"llama-cpp-python=={version}", "-d", str(workdir)],
        check=True,
    )  # fmt: skip
    with tarfile.open(workdir / f"llama_cpp_python-{version}.tar.gz") as tf:
        tf.extractall(workdir, filter="data")
    return src


def to_gguf(hf: Path, workdir: Path, shape: str) -> Path:
    """HF checkpoint -> GGUF f16 (vendored converter) -> Q4_0 (llama_model_quantize)."""
    import llama_cpp

    q4 = workdir / f"{shape}-q4_0.gguf"
    if q4.exists():
        return q4
    f16 = workdir / f"{shape}-f16.gguf"
    if not f16.exists():
        shim = workdir / "convert_shim.py"
        shim.write_text(_CONVERT_SHIM)
        src = llama_source(workdir)
        _log(f"{shape}: converting to GGUF f16")
        cmd = [sys.executable, str(shim), str(src), str(hf), "--outtype", "f16"]
        subprocess.run([*cmd, "--outfile", str(f16)], check=True)
    _log(f"{shape}: quantizing to Q4_0")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    params.nthread = len(os.sched_getaffinity(0))
    rc = llama_cpp.llama_model_quantize(str(f16).encode(), str(q4).encode(), params)
    if rc != 0:
        raise SystemExit(f"llama_model_quantize failed ({rc})")
    return q4


def to_colibri(hf: Path, workdir: Path, shape: str) -> Path:
    from storage.convert import ConvertOptions, convert

    out = workdir / f"{shape}-colibri"
    if not (out / "config.json").exists():
        _log(f"{shape}: coli convert (int4-g64)")
        convert(hf, out, ConvertOptions())
    return out


# ----------------------------------------------------------------------------- timing


class Ours:
    def __init__(self, path: Path, kernels: str = "exact", threads: int | None = None) -> None:
        import colibri

        self.name = "colibri" if kernels == "exact" else f"colibri {kernels}"
        self._stack = contextlib.ExitStack()
        self.model = self._stack.enter_context(
            colibri.open_model(path, learn=False, kernels=kernels, threads=threads)
        )

    def prefill(self, ids: list[int]) -> float:
        t = time.perf_counter()
        self.model.generate(ids, max_new_tokens=1)
        return time.perf_counter() - t

    def decode(self, ids: list[int], n: int) -> tuple[float, int]:
        """(seconds for tokens 2..n, tokens after the first): prefill excluded by difference."""
        t0 = time.perf_counter()
        got = self.model.generate(ids, max_new_tokens=n)
        total = time.perf_counter() - t0
        return total - self.prefill(ids), len(got) - 1

    def info(self) -> dict[str, Any]:
        c = self.model.stats()["compute"]
        return {"threads": c["threads"], "kernels": c["kernels"]}

    def close(self) -> None:
        self._stack.close()


class _LocalPeer:
    """llama.cpp through llama-cpp-python in this process (the worker of :class:`Peer`)."""

    name = "llama.cpp"

    def __init__(self, gguf: Path, threads: int, extra_bufts: bool) -> None:
        import llama_cpp
        import llama_cpp.llama_cpp as low

        self.threads = threads
        # ``extra_bufts``: llama.cpp's repacked (and, where present, AMX) weight buffers, its
        # default. Llama() swallows unknown keywords (``use_extra_bufts=False`` given to it does
        # nothing), so the choice goes into the model parameters that Llama() asks
        # llama_model_default_params() for while it loads.
        default_params = low.llama_model_default_params

        def params() -> Any:
            p = default_params()
            p.use_extra_bufts = extra_bufts
            return p

        low.llama_model_default_params = params
        try:
            self.llm = llama_cpp.Llama(
                model_path=str(gguf),
                n_ctx=2048,
                n_batch=512,
                n_threads=threads,
                n_threads_batch=threads,
                verbose=False,
            )
        finally:
            low.llama_model_default_params = default_params
        self.prefill([1, 2, 3])  # a graph that the backends cannot place aborts here

    def prefill(self, ids: list[int]) -> float:
        self.llm.reset()
        t = time.perf_counter()
        self.llm.eval(ids)
        self.llm.sample(top_k=1, temp=0.0)
        return time.perf_counter() - t

    def decode(self, ids: list[int], n: int) -> tuple[float, int]:
        self.llm.reset()
        self.llm.eval(ids)
        tok = self.llm.sample(top_k=1, temp=0.0)
        t = time.perf_counter()
        for _ in range(n - 1):
            self.llm.eval([tok])
            tok = self.llm.sample(top_k=1, temp=0.0)
        return time.perf_counter() - t, n - 1

    def info(self) -> dict[str, Any]:
        return {"threads": self.threads, "quant": "Q4_0"}

    def close(self) -> None:
        self.llm.close()


class Peer:
    """llama.cpp in a worker process (``--peer-worker``) whose environment has no
    ``OMP_WAIT_POLICY`` (this tool sets ``PASSIVE`` for numba, as colibri does): llama.cpp's
    OpenMP threads spin between its many small parallel regions by default, and passive waiting
    cost it ~25% of its decode speed (31 against 40.5 tok/s on the DeepSeek-V3 shape, Intel
    guest, 2026-12-05). Its process sleeps while the other engines run."""

    name = "llama.cpp"

    def __init__(self, gguf: Path, threads: int) -> None:
        self.threads = threads
        # llama.cpp's default first (repacked weight buffers); MLA models in Q4_0 abort with
        # them on some CPUs (GGML_ASSERT cur_backend_id != -1, seen on an AMX Intel guest with
        # 0.3.36), and then it runs without them: its best setting that works here.
        self.extra_bufts = True
        try:
            self._start(gguf, threads)
        except RuntimeError as exc:
            _log(f"llama.cpp: {exc}; again without the extra buffer types (use_extra_bufts=0)")
            self.extra_bufts = False
            self._start(gguf, threads)

    def _start(self, gguf: Path, threads: int) -> None:
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--peer-worker", str(gguf)]
        self._proc = subprocess.Popen(
            [*cmd, str(threads), str(int(self.extra_bufts))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        self._ask({"op": "ready"})

    def _ask(self, req: dict[str, Any]) -> dict[str, Any]:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        try:
            self._proc.stdin.write(json.dumps(req) + "\n")
            self._proc.stdin.flush()
        except OSError:  # it already exited: say how, below
            pass
        for line in self._proc.stdout:
            if line.startswith(_REPLY):
                reply: dict[str, Any] = json.loads(line[len(_REPLY) :])
                return reply
        raise RuntimeError(f"the llama.cpp worker exited (status {self._proc.wait()})")

    def prefill(self, ids: list[int]) -> float:
        return float(self._ask({"op": "prefill", "ids": ids})["s"])

    def decode(self, ids: list[int], n: int) -> tuple[float, int]:
        r = self._ask({"op": "decode", "ids": ids, "n": n})
        return float(r["s"]), int(r["n"])

    def info(self) -> dict[str, Any]:
        return {
            "threads": self.threads,
            "quant": "Q4_0",
            "process": "own, OMP_WAIT_POLICY unset (llama.cpp's default spin-then-sleep)",
            "use_extra_bufts": self.extra_bufts,
        }

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._ask({"op": "close"})
        self._proc.wait(timeout=60)


_REPLY = "@@peer "  # marks the worker's replies on its stdout (anything else there is skipped)


def _peer_worker(gguf: str, threads: int, extra_bufts: bool) -> int:
    """Serve :class:`Peer` requests (JSON lines on stdin) with a :class:`_LocalPeer`."""
    # this file set PASSIVE at import; libgomp reads the variable when llama_cpp loads it
    os.environ.pop("OMP_WAIT_POLICY", None)
    peer = _LocalPeer(Path(gguf), threads, extra_bufts)
    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        if op == "prefill":
            reply: dict[str, Any] = {"s": peer.prefill(req["ids"])}
        elif op == "decode":
            sec, n = peer.decode(req["ids"], req["n"])
            reply = {"s": sec, "n": n}
        else:
            reply = {}
        print(_REPLY + json.dumps(reply), flush=True)
        if op == "close":
            break
    peer.close()
    return 0


def _prompt(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(v) for v in rng.integers(3, 900, n)]  # ids inside the real tokenizer's range


def bench_shape(
    shape: str,
    ours_path: Path,
    gguf: Path,
    rounds: int,
    tokens: int,
    lossy: bool,
    threads: int,
) -> dict[str, Any]:
    """Both engines on ``threads`` threads."""
    engines: list[Any] = [Ours(ours_path, threads=threads), Peer(gguf, threads)]
    if lossy:  # the opt-in --kernels fast-int8, reported beside (never the figure)
        engines.append(Ours(ours_path, "fast-int8", threads=threads))
    p64, p512 = _prompt(64, 1), _prompt(512, 2)
    res: dict[str, dict[str, list[float]]] = {
        e.name: {"prefill_64": [], "prefill_512": [], "decode": []} for e in engines
    }
    try:
        for e in engines:  # warm: JIT, caches, first allocations
            e.prefill(p64)
            e.decode(p64, 4)
        for r in range(rounds):
            order = engines if r % 2 == 0 else engines[::-1]  # interleaved, alternating order
            for e in order:
                res[e.name]["prefill_64"].append(64 / e.prefill(p64))
                res[e.name]["prefill_512"].append(512 / e.prefill(p512))
                sec, n = e.decode(p64, tokens)
                res[e.name]["decode"].append(n / sec)
                _log(
                    f"{shape} round {r + 1}: {e.name:19} decode {res[e.name]['decode'][-1]:6.1f} "
                    f"tok/s, prefill 64: {res[e.name]['prefill_64'][-1]:6.1f} tok/s, "
                    f"512: {res[e.name]['prefill_512'][-1]:6.1f} tok/s"
                )
        infos = {e.name: e.info() for e in engines}
    finally:
        for e in engines:
            e.close()
    med = {k: {m: round(statistics.median(v), 2) for m, v in d.items()} for k, d in res.items()}
    ours, peer = med["colibri"], med["llama.cpp"]
    lossy_ratios = {
        name: {m: round(v / peer[m], 3) for m, v in vals.items()}
        for name, vals in med.items()
        if name not in ("colibri", "llama.cpp")
    }
    return {
        "decode_ratio": round(ours["decode"] / peer["decode"], 3),
        "prefill_ratio": {
            "64": round(ours["prefill_64"] / peer["prefill_64"], 3),
            "512": round(ours["prefill_512"] / peer["prefill_512"], 3),
        },
        "lossy_ratios": lossy_ratios,
        "medians_tok_s": med,
        "rounds_tok_s": res,
        "engines": infos,
    }


def _cpu() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--peer-worker"]:
        return _peer_worker(argv[1], int(argv[2]), argv[3] == "1")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp/colibri-peer"))
    ap.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    ap.add_argument("--rounds", type=positive, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--tokens", type=positive, default=48, help="greedy tokens per decode run")
    ap.add_argument(
        "--threads",
        type=positive,
        default=None,
        help="threads for both engines (default: every CPU this process may use); 1 compares "
        "the kernels without the parallel part",
    )
    ap.add_argument(
        "--no-lossy",
        action="store_true",
        help="skip the third engine, colibri with the opt-in lossy --kernels fast-int8",
    )
    args = ap.parse_args(argv)
    try:
        version = importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        why = (
            "llama-cpp-python is not installed: pip install llama-cpp-python (its sdist builds "
            "llama.cpp from source, 7-17 minutes on 2 cores)"
        )
        print(why, file=sys.stderr)
        print(json.dumps({"figure": None, "figure_reason": why}))  # the last-line contract
        return 1
    from runtime.kernels.isa import kernel_info

    args.workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    threads = args.threads or len(os.sched_getaffinity(0))
    shapes: dict[str, Any] = {}
    for shape in args.shapes:
        hf = args.workdir / f"{shape}-hf"
        if not (hf / ".complete").exists():
            _log(f"{shape}: making the HF checkpoint (seeded, bf16)")
            make_checkpoint(shape, hf)
        ours = to_colibri(hf, args.workdir, shape)
        gguf = to_gguf(hf, args.workdir, shape)
        shapes[shape] = bench_shape(
            shape, ours, gguf, args.rounds, args.tokens, not args.no_lossy, threads
        )
        shapes[shape]["parameters"] = json.loads((hf / ".complete").read_text())["parameters"]
        _log(f"{shape}: decode ratio {shapes[shape]['decode_ratio']}, prefill ratio "
             f"{shapes[shape]['prefill_ratio']}")  # fmt: skip
    out = {
        "figure": min(s["decode_ratio"] for s in shapes.values()),
        "figure_is": "colibri decode tok/s / llama.cpp Q4_0 decode tok/s, medians of "
        "interleaved rounds, the lower over the shapes",
        "prefill_ratio": {k: s["prefill_ratio"] for k, s in shapes.items()},
        "shapes": shapes,
        "threads": threads,
        "machine": {"cpu": _cpu(), "nproc": os.cpu_count(), "kernels": kernel_info().as_dict()},
        "llama_cpp_python": version,
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
