"""`coli pull` against a loopback hub (tests/_hub.py: the hub's HTTP layout, no network): a
Hugging Face checkpoint is converted shard by shard as it lands (the source never on disk whole,
the container byte-identical to `coli convert` of the same files), an interrupted pull resumes,
and a repository that already is a colibri container is downloaded and verified."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _demo import demo_model
from _hub import serve_hub

from colibri.pull import pull
from storage.convert import ConvertOptions, convert
from storage.errors import ColibriError

torch = pytest.importorskip("torch", reason="the test checkpoint is written with torch")
OPTS = ConvertOptions(shard_size=1 << 20)


def _layer_sharded(src: Path, dst: Path) -> None:
    """``src`` (one-file HF checkpoint) re-sharded as real ones are: the embedding with layer 0,
    one file per layer after it, the final norm and lm_head in the last file."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    tensors = load_file(str(src / "model.safetensors"))
    layers = sorted({int(k.split(".")[2]) for k in tensors if k.startswith("model.layers.")})
    n = len(layers)
    files: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in tensors.items():
        if k.startswith("model.layers."):
            i = layers.index(int(k.split(".")[2]))
        else:
            i = 0 if "embed_tokens" in k else n - 1
        files.setdefault(f"model-{i + 1:05d}-of-{n:05d}.safetensors", {})[k] = v
    weight_map = {}
    for name, part in files.items():
        save_file(part, str(dst / name), metadata={"format": "pt"})
        weight_map |= {k: name for k in part}
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.fixture(scope="module")
def checkpoint(oracle_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hub") / "ckpt"
    _layer_sharded(oracle_dir / "deepseek_v3", root)
    return root


def _shards(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.glob("*.safetensors"))}


def test_pull_converts_shard_by_shard(checkpoint: Path, tmp_path: Path) -> None:
    ref = tmp_path / "ref"
    convert(checkpoint, ref, OPTS)
    out = tmp_path / "models" / "dsv3"
    with serve_hub({"org/dsv3": checkpoint}) as hub:
        res = pull("org/dsv3", out, endpoint=hub.url, options=OPTS)
        ranged = [r for r in hub.requests if r[2] is not None]
    assert res.kind == "converted" and res.convert is not None
    shard_sizes = [p.stat().st_size for p in checkpoint.glob("*.safetensors")]
    assert res.source_bytes == sum(shard_sizes)
    # never the whole source: at most the two or three shards one output shard reads
    assert res.peak_source_bytes <= sum(sorted(shard_sizes)[-3:]) < res.source_bytes
    assert len(ranged) == 2 * len(shard_sizes)  # each header: its length, then the JSON
    assert _shards(out) == _shards(ref)
    for side in ("config.json", "tokenizer.json", "generation_config.json"):
        assert (out / side).read_bytes() == (ref / side).read_bytes()
    assert not (tmp_path / "models" / ".dsv3.pull-source").exists()  # staging removed


def test_interrupted_pull_resumes(checkpoint: Path, tmp_path: Path) -> None:
    ref = tmp_path / "ref"
    convert(checkpoint, ref, OPTS)
    out = tmp_path / "dsv3"
    downloads: list[str] = []

    def stop_at_the_fifth(done: int, total: int | None, msg: str) -> None:
        if total is None and msg.startswith("downloading model-"):
            downloads.append(msg)
            if len(downloads) == 5:  # two output shards are done by then (they read 4 files)
                raise KeyboardInterrupt  # Ctrl-C as the fifth source shard starts

    with serve_hub({"org/dsv3": checkpoint}) as hub:
        with pytest.raises(KeyboardInterrupt):
            pull("org/dsv3", out, endpoint=hub.url, options=OPTS, progress=stop_at_the_fifth)
        assert list(out.glob("out-*.safetensors")), "nothing was converted before the stop"
        first = len(hub.requests)
        res = pull("org/dsv3", out, endpoint=hub.url, options=OPTS)
        fetched = {p for m, p, r in hub.requests[first:] if m == "GET" and r is None}
    assert res.convert is not None and any("resumed" in n for n in res.convert.notes)
    assert _shards(out) == _shards(ref)
    # the converted part was not fetched again
    assert len([p for p in fetched if p.endswith(".safetensors")]) < len(list(
        checkpoint.glob("*.safetensors")))  # fmt: skip


def test_pull_of_a_container_downloads_and_verifies(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(demo_model(), repo)
    out = tmp_path / "out"
    with serve_hub({"org/demo": repo}) as hub:
        res = pull("org/demo", out, endpoint=hub.url)
        assert res.kind == "container" and _shards(out) == _shards(repo)
        # a shard damaged on the hub: the download is refused by the manifest's checksum
        victim = sorted(repo.glob("out-*.safetensors"))[0]
        data = bytearray(victim.read_bytes())
        data[-10] ^= 0xFF
        victim.write_bytes(bytes(data))
        with pytest.raises(ColibriError, match="SHA-256 differs from the manifest"):
            pull("org/demo", tmp_path / "out2", endpoint=hub.url)
        with pytest.raises(ColibriError, match="no such repository"):
            pull("org/nope", tmp_path / "out3", endpoint=hub.url)


def test_coli_pull_command(checkpoint: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLI_")}
    env["HOME"] = str(tmp_path)
    with serve_hub({"org/dsv3": checkpoint}) as hub:
        r = subprocess.run(
            [sys.executable, "-m", "colibri.cli", "pull", "org/dsv3", str(tmp_path / "m"),
             "--endpoint", hub.url, "--shard-size", "1MiB"],
            capture_output=True, text=True, env=env, timeout=300,
        )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "org/dsv3@0123456789ab converted" in r.stdout and "at most" in r.stdout
    args = [sys.executable, "-m", "colibri.cli", "doctor", "--model", str(tmp_path / "m")]
    doctor = subprocess.run(args, capture_output=True, text=True, env=env)
    assert doctor.returncode == 0, doctor.stdout


def test_pull_errors_are_one_line(tmp_path: Path) -> None:
    """A hub that does not answer (a closed loopback port) and a malformed repository id are
    one `error:` line each, whatever HTTP client the installed huggingface_hub uses."""
    import socket

    env = {k: v for k, v in os.environ.items() if not k.startswith("COLI_")}
    env["HOME"] = str(tmp_path)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for repo, endpoint, want in (
        ("org/m", f"http://127.0.0.1:{port}", "cannot list the repository"),
        ("bad//id", f"http://127.0.0.1:{port}", "is not a repository id"),
    ):
        r = subprocess.run(
            [sys.executable, "-m", "colibri.cli", "pull", repo, str(tmp_path / "m"),
             "--endpoint", endpoint],
            capture_output=True, text=True, env=env, timeout=120,
        )  # fmt: skip
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        errors = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
        assert len(errors) == 1 and want in errors[0], r.stderr


def test_an_interrupted_pull_stays_on_its_commit_and_force_starts_over(
    checkpoint: Path, tmp_path: Path
) -> None:
    """The repository moved on between an interrupted pull and its rerun: the rerun finishes
    the commit it started (pinned beside OUT; it refused, naming the hidden staging dir and
    a --force pull did not have); another --revision is refused unless --force."""
    out = tmp_path / "dsv3"
    first_commit = "0123456789abcdef0123456789abcdef01234567"

    def stop(done: int, total: int | None, msg: str) -> None:
        if total is None and msg.startswith("downloading model-00003"):
            raise KeyboardInterrupt

    with serve_hub({"org/dsv3": checkpoint}) as hub:
        with pytest.raises(KeyboardInterrupt):
            pull("org/dsv3", out, endpoint=hub.url, options=OPTS, progress=stop)
        hub.commit = "f" * 40  # a new commit on main (the same files)
        other = "e" * 40
        with pytest.raises(ColibriError, match=r"pinned to commit 0123456789ab.*--force"):
            pull("org/dsv3", out, endpoint=hub.url, options=OPTS, revision=other)
        res = pull("org/dsv3", out, endpoint=hub.url, options=OPTS)
        assert res.commit == first_commit and res.convert is not None
        assert any("resumed" in n for n in res.convert.notes)
        assert not (tmp_path / ".dsv3.pull.json").exists()  # finished: no pin left
        # a new pull into the same OUT after an interruption: --force starts over there
        out2 = tmp_path / "again"
        with pytest.raises(KeyboardInterrupt):
            pull("org/dsv3", out2, endpoint=hub.url, options=OPTS, progress=stop)
        res2 = pull("org/dsv3", out2, endpoint=hub.url, options=OPTS, revision=other, force=True)
        assert res2.commit == other and _shards(out2) == _shards(out)


def test_a_container_pull_fetches_a_damaged_file_again_and_refuses_format_flags(
    tmp_path: Path,
) -> None:
    """A shard of the right size that fails the manifest's checksum (damaged, or from an older
    commit) was kept by every rerun, which then failed the same way forever: it is fetched
    again. Format flags for a container repository are an error, not silently dropped."""
    repo = tmp_path / "repo"
    shutil.copytree(demo_model(), repo)
    out = tmp_path / "out"
    with serve_hub({"org/demo": repo}) as hub:
        pull("org/demo", out, endpoint=hub.url)
        victim = sorted(out.glob("out-*.safetensors"))[0]
        data = bytearray(victim.read_bytes())
        data[-10] ^= 0xFF
        victim.write_bytes(bytes(data))
        pull("org/demo", out, endpoint=hub.url)
        assert _shards(out) == _shards(repo)
        with pytest.raises(ColibriError, match="already a colibri container"):
            pull("org/demo", tmp_path / "out2", endpoint=hub.url, options=OPTS)
