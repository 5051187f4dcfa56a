"""storage.container on public-layout fixtures: indexes, expert extents, reads, and every
user-caused problem as a ColibriError naming the file and the tensor."""

from __future__ import annotations

import json
import shutil
from itertools import pairwise
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from helpers_storage import DEFAULT_POLICY, Arrays, make_container, rewrite, tiny_config

from storage.container import Container, shard_paths
from storage.errors import (
    ColibriError,
    ConfigError,
    ContainerError,
    ExpertLayoutError,
    FormatError,
    SafetensorsError,
    TensorNotFoundError,
)
from storage.public_layout import dtype_sort_key, write_public_container
from storage.quant import QTensor, dequantize
from storage.safetensors import PAD_PREFIX, TensorSpec, read_header, write_safetensors

EXPERT = "model.layers.1.mlp.experts.2.{}.weight"


@pytest.fixture(scope="module")
def good(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, dict[str, npt.NDArray[np.float32]]]:
    path, weights, _ = make_container(tmp_path_factory.mktemp("good") / "model")
    return path, weights


@pytest.fixture
def copy(good: tuple[Path, object], tmp_path: Path) -> Path:
    """A private copy of the good container that a test may break."""
    return Path(shutil.copytree(good[0], tmp_path / "model"))


def assert_names(err: BaseException, *parts: object) -> None:
    assert isinstance(err, ColibriError)
    for p in parts:
        assert str(p) in str(err), (p, str(err))


# ----------------------------------------------------------------------------- the good path


def test_open_exposes_config_side_files_and_shards(good: tuple[Path, object]) -> None:
    c = Container.open(good[0])
    assert c.path == good[0]
    assert c.config["hidden_size"] == 64 and c.arch.model_type == "glm_moe_dsa"
    assert c.generation_config["temperature"] == 1.0
    assert c.eos_token_ids == [1, 2, 3]  # config [1, 2] united with generation_config [2, 3]
    assert [sh.path.name for sh in c.shards] == [
        "out-00000.safetensors",
        "out-mtp-00000.safetensors",
    ]
    assert c.manifest is None and c.problems == []
    assert c.tokenizer_path() == good[0] / "tokenizer.json"
    assert c.tokenizer_config()["eos_token"] == "<eos>"
    assert "Container(" in repr(c)


def test_entries_roles_formats_and_names(good: tuple[Path, object]) -> None:
    c = Container.open(good[0])
    names = c.names()
    assert names == sorted(names)
    assert not any(n.endswith(".qs") or n.startswith(PAD_PREFIX) for n in names)
    assert c.has("lm_head.weight") and not c.has("lm_head.weight.qs")
    up = c.entry(EXPERT.format("up_proj"))
    assert (up.role, up.shape, up.fmt and up.fmt.kind) == ("expert", (96, 64), "int4")
    assert up.scales is not None and up.scales.name.endswith(".qs") and up.scales.dtype == "F32"
    assert up.nbytes == up.weight.nbytes + up.scales.nbytes
    down = c.entry(EXPERT.format("down_proj"))
    assert down.shape == (64, 96) and down.fmt is not None and down.fmt.name == "int4-g64"
    io = c.entry("model.embed_tokens.weight")
    assert io.role == "io" and io.fmt is not None and io.fmt.name == "int8"
    mtp = c.entry("model.layers.2.eh_proj.weight")
    assert mtp.role == "mtp" and mtp.fmt is not None and mtp.fmt.name == "int8"
    assert mtp.weight.path.name == "out-mtp-00000.safetensors"
    norm = c.entry("model.layers.1.input_layernorm.weight")
    assert (norm.role, norm.fmt, norm.shape, norm.scales) == ("f32", None, (64,), None)
    router = c.entry("model.layers.1.mlp.gate.weight")
    assert router.role == "f32" and router.fmt is not None and router.fmt.name == "f32"


def test_loads_match_what_was_written(
    good: tuple[Path, dict[str, npt.NDArray[np.float32]]],
) -> None:
    path, weights = good
    c = Container.open(path)
    for name in ("model.norm.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
                 "model.layers.0.self_attn.indexer.k_norm.bias"):  # fmt: skip
        np.testing.assert_array_equal(c.load_f32(name), weights[name])
    router = c.load_f32("model.layers.1.mlp.gate.weight")
    assert router.shape == (4, 64)
    np.testing.assert_array_equal(router, weights["model.layers.1.mlp.gate.weight"])
    q = c.load_qtensor("lm_head.weight")
    assert q.data.dtype == np.uint8 and q.data.ndim == 1 and q.scales is not None
    np.testing.assert_array_equal(c.load_f32("lm_head.weight"), dequantize(q))
    err = np.abs(dequantize(q) - weights["lm_head.weight"]).max()
    assert err < np.abs(weights["lm_head.weight"]).max() / 127  # int8: half a step per row at most
    with pytest.raises(FormatError, match="load_f32") as exc:
        c.load_qtensor("model.norm.weight")
    assert_names(exc.value, path, "model.norm.weight")


def test_every_expert_extent_is_contiguous_and_reads_back(good: tuple[Path, object]) -> None:
    c = Container.open(good[0])
    assert c.expert_layers() == [1, 2]  # layer 0 is dense, layer 2 is the MTP layer
    extents = c.expert_extents()
    assert [(x.layer, x.expert) for x in extents] == [(la, e) for la in (1, 2) for e in range(4)]
    for x in extents:
        assert x is c.expert(x.layer, x.expert)
        spans = sorted((off, off + nb) for off, nb, _, _ in x.parts.values())
        assert spans[0][0] == 0 and spans[-1][1] == x.nbytes
        assert all(a[1] == b[0] for a, b in pairwise(spans))
        # public layout: down, gate, up in alphabetical order
        assert sorted(x.parts, key=lambda p: x.parts[p][0]) == ["down_proj", "gate_proj", "up_proj"]
        blob = x.read_blob()
        assert blob.size == x.nbytes
        scales = x.read_scales()
        views = x.qtensors(blob, scales)
        # a larger (e.g. 4 KiB-aligned) read buffer whose first bytes are the blob works too
        big = np.zeros(x.nbytes + 4096, np.uint8)
        big[: x.nbytes] = blob
        for proj, qt in x.qtensors(big, scales).items():
            name = f"model.layers.{x.layer}.mlp.experts.{x.expert}.{proj}.weight"
            ref = c.load_qtensor(name)
            assert qt.fmt == ref.fmt and qt.shape == ref.shape
            assert np.shares_memory(qt.data, big)  # zero copy
            np.testing.assert_array_equal(dequantize(qt), dequantize(ref))
            np.testing.assert_array_equal(dequantize(views[proj]), dequantize(ref))
    assert c.expert_nbytes == max(x.nbytes for x in extents)
    assert c.expert(2, 0).nbytes > c.expert(1, 0).nbytes  # the MTP layer is int8


def test_expert_views_validate_inputs(good: tuple[Path, object]) -> None:
    x = Container.open(good[0]).expert(1, 0)
    blob, scales = x.read_blob(), x.read_scales()
    with pytest.raises(ContainerError, match="at least"):
        x.qtensors(blob[:-1], scales)
    with pytest.raises(FormatError, match="no scales"):
        x.qtensors(blob, {**scales, "up_proj": None})
    with pytest.raises(FormatError, match="scales"):
        x.qtensors(blob, {**scales, "up_proj": np.zeros(3, np.float32)})


def test_absent_tensors_and_experts(good: tuple[Path, object]) -> None:
    c = Container.open(good[0])
    with pytest.raises(TensorNotFoundError) as exc:
        c.entry("model.layers.9.mlp.up_proj.weight")
    assert_names(exc.value, good[0], "model.layers.9.mlp.up_proj.weight")
    for layer, expert in ((0, 0), (1, 4), (7, 0)):
        with pytest.raises(ContainerError, match=f"layer {layer} expert {expert}"):
            c.expert(layer, expert)


def test_multi_shard_split_at_layer_boundaries(tmp_path: Path) -> None:
    cfg = tiny_config(num_hidden_layers=4, mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
                      indexer_types=["full", "shared", "full", "shared"])  # fmt: skip
    path, weights, _ = make_container(tmp_path / "m", cfg, shard_bytes=40_000)
    c = Container.open(path)
    main = [sh for sh in c.shards if not sh.path.name.startswith("out-mtp-")]
    assert len(main) >= 3
    assert [sh.path.name for sh in main] == [f"out-{k:05d}.safetensors" for k in range(len(main))]
    for sh in c.shards:  # a layer never straddles shards
        layers = {n.split(".")[2] for n in sh.tensors if n.startswith("model.layers.")}
        for other in c.shards:
            if other is not sh:
                assert not layers & {n.split(".")[2] for n in other.tensors
                                     if n.startswith("model.layers.")}  # fmt: skip
    assert len(c.expert_extents()) == 4 * 4
    np.testing.assert_array_equal(c.load_f32("model.norm.weight"), weights["model.norm.weight"])


def test_plain_hf_bf16_checkpoint_opens(tmp_path: Path) -> None:
    policy = dict.fromkeys(DEFAULT_POLICY, "bf16")
    path, _, stored = make_container(tmp_path / "hf", policy=policy)
    (path / "out-00000.safetensors").rename(path / "model-00001-of-00002.safetensors")
    (path / "out-mtp-00000.safetensors").rename(path / "model-00002-of-00002.safetensors")
    c = Container.open(path)
    assert [sh.path.name for sh in c.shards] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    x = c.expert(1, 3)
    views = x.qtensors(x.read_blob(), x.read_scales())
    assert all(s is None for s in x.read_scales().values())
    for proj, qt in views.items():
        name = f"model.layers.1.mlp.experts.3.{proj}.weight"
        assert qt.fmt.name == "bf16" and qt.data.dtype == np.uint16
        ref = stored[name]
        assert isinstance(ref, QTensor)
        np.testing.assert_array_equal(dequantize(qt), dequantize(ref))
        np.testing.assert_array_equal(c.load_f32(name), dequantize(ref))
    assert c.load_qtensor("lm_head.weight").data.dtype == np.uint16


@pytest.mark.parametrize("fmt_name", ["f32", "f16"])
def test_unquantized_matrices(tmp_path: Path, fmt_name: str) -> None:
    policy = dict.fromkeys(DEFAULT_POLICY, fmt_name)
    path, weights, _ = make_container(tmp_path / "m", policy=policy, with_tokenizer=False)
    c = Container.open(path)
    assert c.tokenizer_path() is None and c.tokenizer_config() == {}
    name = EXPERT.format("down_proj")
    x = c.expert(1, 2)
    qt = x.qtensors(x.read_blob(), x.read_scales())["down_proj"]
    want = weights[name] if fmt_name == "f32" else weights[name].astype(np.float16)
    np.testing.assert_array_equal(dequantize(qt), want.astype(np.float32))
    np.testing.assert_array_equal(c.load_f32(name), want.astype(np.float32))


def test_unquantized_matrix_stored_1d_is_accepted(copy: Path) -> None:
    name = "model.layers.1.mlp.gate.weight"

    def flatten(t: Arrays) -> None:
        t[name] = (t[name][0], t[name][1].reshape(-1))

    rewrite(copy / "out-00000.safetensors", flatten)
    c = Container.open(copy)
    assert c.entry(name).shape == (4, 64)
    assert c.load_f32(name).shape == (4, 64)


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("model.norm.weight", (1,)),
        ("model.norm.weight", (1, 64)),
        ("model.norm.weight", (32,)),
        ("model.layers.1.input_layernorm.weight", (1,)),
        ("model.layers.1.mlp.gate.e_score_correction_bias", (1,)),
        ("model.layers.0.self_attn.kv_a_layernorm.weight", (64,)),
    ],
)
def test_a_norm_or_bias_of_another_length_is_refused(
    copy: Path, name: str, shape: tuple[int, ...]
) -> None:
    """Such a vector was broadcast at run time (wrong logits, the doctor passing it) or failed
    inside the forward with numpy's error: the container is refused at open, naming the file,
    the tensor and the length config.json implies."""

    def resize(t: Arrays) -> None:
        t[name] = (t[name][0], np.ones(shape, dtype=t[name][1].dtype))

    rewrite(copy / "out-00000.safetensors", resize)
    with pytest.raises(FormatError, match=rf"out-00000\.safetensors: tensor '{name}'.*implies"):
        Container.open(copy)


def test_a_shard_the_index_lists_or_the_numbering_skips_is_named(copy: Path) -> None:
    """Without a manifest, a shard missing from a Hugging Face index was found only through
    the tensors it held ("the conversion is incomplete", or an MTP layer silently absent),
    and a gap in the public layout's out-NNNNN numbering went unseen (coli info counting no
    MoE layer): the missing file is named."""
    (copy / "out-mtp-00000.safetensors").rename(copy / "out-mtp-00001.safetensors")
    with pytest.raises(ContainerError) as err:
        Container.open(copy)
    assert_names(err.value, copy / "out-mtp-00000.safetensors", "numbered")
    other = copy.parent / "second-drive"  # shards split over directories (--model-dir)
    other.mkdir()
    (copy / "out-mtp-00001.safetensors").rename(other / "out-mtp-00001.safetensors")
    with pytest.raises(ContainerError) as err:
        Container.open(copy, shard_dirs=[other])
    assert_names(err.value, "out-mtp-00000.safetensors", "numbered")
    (other / "out-mtp-00001.safetensors").rename(copy / "out-mtp-00000.safetensors")
    names = {
        n: "out-00000.safetensors" for n in read_header(copy / "out-00000.safetensors").tensors
    }
    names["model.layers.2.extra"] = "model-00002-of-00002.safetensors"
    (copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": names}))
    with pytest.raises(ContainerError) as err:
        Container.open(copy)
    assert_names(err.value, copy / "model-00002-of-00002.safetensors", "index.json")


def test_manifest_is_exposed(copy: Path) -> None:
    from _demo import demo_model

    converted = demo_model()
    doc = json.loads((converted / "colibri-manifest.json").read_text())
    assert Container.open(converted).manifest == doc
    # one the converter could not have written is refused at open (its shard list would
    # otherwise be ignored), naming the file and the field
    (copy / "colibri-manifest.json").write_text(json.dumps({"format": "colibri-container"}))
    with pytest.raises(ConfigError, match=r"colibri-manifest\.json") as exc:
        Container.open(copy)
    assert_names(exc.value, copy / "colibri-manifest.json")
    (copy / "colibri-manifest.json").write_text("{oops")
    with pytest.raises(ConfigError) as exc:
        Container.open(copy)
    assert_names(exc.value, copy / "colibri-manifest.json")


# ----------------------------------------------------------------------------- layout errors


def test_expert_not_adjacent(copy: Path) -> None:
    shard = copy / "out-00000.safetensors"
    gate = EXPERT.format("gate_proj")

    def last(dtype: str, n: str) -> object:
        # the public order, but one matrix moved to the end of the shard
        return (1, (0, "")) if n == gate else (0, dtype_sort_key(dtype, n))

    rewrite(shard, order=last)
    with pytest.raises(ExpertLayoutError, match="not byte-adjacent") as exc:
        Container.open(copy)
    assert_names(exc.value, shard, "layer 1 expert 2", "gate_proj", "down_proj")
    c = Container.open(copy, strict=False)
    assert len(c.problems) == 1 and isinstance(c.problems[0], ExpertLayoutError)
    with pytest.raises(ExpertLayoutError):
        c.expert(1, 2)
    c.expert(1, 1)  # the others are fine


def test_padding_inside_an_expert_is_not_allowed(copy: Path) -> None:
    shard = copy / "out-00000.safetensors"
    rewrite(shard, align={EXPERT.format("gate_proj"): 4096})
    assert any(n.startswith(PAD_PREFIX) for n in read_header(shard).tensors)
    with pytest.raises(ExpertLayoutError, match="layer 1 expert 2") as exc:
        Container.open(copy)
    assert_names(exc.value, shard)


def test_padding_between_experts_is_fine(copy: Path) -> None:
    shard = copy / "out-00000.safetensors"
    aligned = {f"model.layers.1.mlp.experts.{e}.down_proj.weight": 4096 for e in range(4)}
    rewrite(shard, align=aligned)
    c = Container.open(copy)
    assert all(c.expert(1, e).start % 4096 == 0 for e in range(4))


def test_expert_split_over_shards(copy: Path) -> None:
    up = EXPERT.format("up_proj")
    moved: Arrays = {}

    def take(t: Arrays) -> None:
        moved[up] = t.pop(up)
        moved[up + ".qs"] = t.pop(up + ".qs")

    rewrite(copy / "out-00000.safetensors", take)
    specs = [TensorSpec(n, d, tuple(a.shape)) for n, (d, a) in moved.items()]
    write_safetensors(copy / "out-00001.safetensors", specs, [a for _, a in moved.values()])
    with pytest.raises(ExpertLayoutError, match="split over shards") as exc:
        Container.open(copy)
    assert_names(exc.value, "layer 1 expert 2", "out-00000.safetensors", "out-00001.safetensors")


def test_expert_missing_a_matrix(copy: Path) -> None:
    up = EXPERT.format("up_proj")

    def drop(t: Arrays) -> None:
        del t[up], t[up + ".qs"]

    rewrite(copy / "out-00000.safetensors", drop)
    with pytest.raises(TensorNotFoundError, match="lacks up_proj") as exc:
        Container.open(copy)
    assert_names(exc.value, copy, "layer 1 expert 2")


# ----------------------------------------------------------------------------- config errors


def test_missing_directory_and_missing_config(tmp_path: Path) -> None:
    with pytest.raises(ContainerError, match="does not exist") as exc:
        Container.open(tmp_path / "nope")
    assert_names(exc.value, tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        ContainerError, match=r"not a colibri model directory: config\.json not found"
    ):
        Container.open(tmp_path / "empty")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ContainerError, match="is not a directory"):
        Container.open(tmp_path / "file")


def test_missing_config_key(copy: Path) -> None:
    cfg = json.loads((copy / "config.json").read_text())
    del cfg["hidden_size"]
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as exc:
        Container.open(copy)
    assert_names(exc.value, copy / "config.json", "'hidden_size'")


_DEEP = '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"  # past the parser's recursion limit
_HUGE_INT = '{"hidden_size": ' + "9" * 5000 + "}"  # past Python's int digit limit


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "", _DEEP, _HUGE_INT])
def test_bad_config_json(copy: Path, text: str) -> None:
    (copy / "config.json").write_text(text)
    with pytest.raises(ConfigError) as exc:
        Container.open(copy)
    assert_names(exc.value, copy / "config.json")


def test_bad_config_values(copy: Path) -> None:
    cfg = json.loads((copy / "config.json").read_text())
    for bad in ({"mlp_layer_types": ["dense"]}, {"model_type": "llama"}, {"hidden_size": "x"},
                {"eos_token_id": "two"}):  # fmt: skip
        (copy / "config.json").write_text(json.dumps({**cfg, **bad}))
        with pytest.raises(ConfigError) as exc:
            Container.open(copy)
        assert_names(exc.value, copy / "config.json")


def test_bad_generation_config(copy: Path) -> None:
    (copy / "generation_config.json").write_text('{"eos_token_id": [1,')
    with pytest.raises(ConfigError) as exc:
        Container.open(copy)
    assert_names(exc.value, copy / "generation_config.json")
    assert Container.open(copy, strict=False).generation_config == {}


def test_eos_single_int(copy: Path) -> None:
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**cfg, "eos_token_id": 5}))
    (copy / "generation_config.json").unlink()
    c = Container.open(copy)
    assert c.eos_token_ids == [5] and c.generation_config == {}


# ----------------------------------------------------------------------------- tensor errors


def test_size_matching_no_format(copy: Path) -> None:
    name = "model.layers.0.self_attn.o_proj.weight"
    shard = copy / "out-00000.safetensors"
    rewrite(shard, lambda t: t.update({name: ("U8", t[name][1][:-1])}))
    with pytest.raises(FormatError, match="match no known format") as exc:
        Container.open(copy)
    assert_names(exc.value, shard, repr(name))
    c = Container.open(copy, strict=False)
    assert not c.has(name) and name in c.unusable
    with pytest.raises(FormatError):
        c.entry(name)


def test_wrong_orientation_is_rejected(copy: Path) -> None:
    name = "model.layers.1.mlp.gate.weight"
    rewrite(
        copy / "out-00000.safetensors", lambda t: t.update({name: ("F32", t[name][1].T.copy())})
    )
    with pytest.raises(FormatError, match=r"stored shape \[64, 4\]") as exc:
        Container.open(copy)
    assert_names(exc.value, repr(name))


def test_fp8_matrix_asks_for_conversion(copy: Path) -> None:
    name = "model.layers.0.mlp.up_proj.weight"

    def fp8(t: Arrays) -> None:
        t.pop(name + ".qs")
        t[name] = ("F8_E4M3", np.zeros((128, 64), np.uint8))

    rewrite(copy / "out-00000.safetensors", fp8)
    with pytest.raises(FormatError, match="coli convert") as exc:
        Container.open(copy)
    assert_names(exc.value, repr(name))


def test_norm_stored_as_bytes_and_non_f32_scales(copy: Path) -> None:
    norm, mat = "model.norm.weight", "model.layers.0.mlp.up_proj.weight"
    shard = copy / "out-00000.safetensors"
    rewrite(shard, lambda t: t.update({norm: ("U8", np.zeros(64, np.uint8))}))
    with pytest.raises(FormatError, match="norm/bias") as exc:
        Container.open(copy)
    assert_names(exc.value, repr(norm))
    rewrite(shard, lambda t: t.update({norm: ("F32", np.ones(64, np.float32))}))
    qs = mat + ".qs"
    rewrite(shard, lambda t: t.update({qs: ("F16", t[qs][1].astype(np.float16))}))
    with pytest.raises(FormatError, match="not F32") as exc:
        Container.open(copy)
    assert_names(exc.value, repr(qs))


def test_orphan_scales(copy: Path) -> None:
    rewrite(copy / "out-00000.safetensors",
            lambda t: t.update({"x.weight.qs": ("F32", np.ones(3, np.float32))}))  # fmt: skip
    with pytest.raises(ContainerError, match="has no weight") as exc:
        Container.open(copy)
    assert_names(exc.value, "'x.weight.qs'")


def test_duplicate_tensor_across_shards(copy: Path) -> None:
    extra = copy / "extra.safetensors"
    norm = np.ones(64, np.float32)
    write_safetensors(extra, [TensorSpec("model.norm.weight", "F32", (64,))], [norm])
    with pytest.raises(ContainerError, match="in both") as exc:
        Container.open(copy)
    assert_names(exc.value, "'model.norm.weight'", "out-00000.safetensors", "extra.safetensors")


def test_truncated_shard(copy: Path) -> None:
    shard = copy / "out-mtp-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(SafetensorsError, match="truncated") as exc:
        Container.open(copy)
    assert_names(exc.value, shard)
    c = Container.open(copy, strict=False)
    assert [sh.path.name for sh in c.shards] == ["out-00000.safetensors"]
    assert isinstance(c.problems[0], SafetensorsError)
    assert not c.has("model.layers.2.eh_proj.weight")


def test_no_shards(copy: Path) -> None:
    for p in shard_paths(copy):
        p.unlink()
    with pytest.raises(ContainerError, match=r"no \*\.safetensors shards") as exc:
        Container.open(copy)
    assert_names(exc.value, copy)


def test_unknown_names_are_kept_without_a_role(copy: Path) -> None:
    extra = {"model.layers.1.mlp.experts.9.up_proj.weight": np.ones(4, np.float32),
             "model.vision.proj.weight": np.ones((2, 2), np.float32),
             # not a weight's scales (only "<X>.weight.qs" are): unknown, not "shards
             # inconsistent" (that refused the container)
             "model.vision.stats.qs": np.ones(3, np.float32)}  # fmt: skip
    specs = [TensorSpec(n, "F32", a.shape) for n, a in extra.items()]
    write_safetensors(copy / "out-extra.safetensors", specs, list(extra.values()))
    c = Container.open(copy)
    for n in extra:
        assert c.entry(n).role is None and c.entry(n).fmt is None
    np.testing.assert_array_equal(c.load_f32("model.vision.proj.weight"), np.ones((2, 2)))
    assert [sh.path.name for sh in c.shards][-1] == "out-extra.safetensors"


def test_writer_refuses_a_directory_with_shards(good: tuple[Path, object], tmp_path: Path) -> None:
    with pytest.raises(ContainerError, match="already holds"):
        write_public_container(good[0], tiny_config(), {})
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        write_public_container(tmp_path / "x", {}, {})


def test_shard_order(tmp_path: Path) -> None:
    names = ["model.safetensors", "out-mtp-00000.safetensors", "out-00001.safetensors",
             "out-idx-00000.safetensors", "out-00000.safetensors", ".out-00002.safetensors",
             "out-00003.safetensors.tmp", "notes.txt"]  # fmt: skip
    for n in names:
        (tmp_path / n).write_bytes(b"")
    (tmp_path / "dir.safetensors").mkdir()
    assert [p.name for p in shard_paths(tmp_path)] == [
        "out-00000.safetensors",
        "out-00001.safetensors",
        "out-mtp-00000.safetensors",
        "model.safetensors",
        "out-idx-00000.safetensors",
    ]


@pytest.mark.parametrize("text", ["{not json", _DEEP, '{"version": ' + "9" * 5000 + "}"])
def test_damaged_manifest_json_is_a_config_error(tmp_path: Path, text: str) -> None:
    from storage.manifest import MANIFEST_NAME, Manifest

    p = tmp_path / MANIFEST_NAME
    p.write_text(text)
    with pytest.raises(ConfigError, match="not valid JSON") as exc:
        Manifest.load(p)
    assert str(p) in str(exc.value)


def test_a_shard_the_manifest_lists_must_be_present(tmp_path: Path) -> None:
    """Deleting a shard the converter wrote (here the MTP one) is an error naming it, not a
    model that silently runs without those tensors."""
    from _demo import TINY

    d = Path(shutil.copytree(TINY, tmp_path / "m"))
    mtp = sorted(d.glob("out-mtp-*.safetensors"))
    assert mtp, "the tiny model has an MTP shard"
    mtp[0].unlink()
    with pytest.raises(ContainerError, match=r"listed in colibri-manifest\.json but missing") as e:
        Container.open(d)
    assert str(mtp[0]) in str(e.value)
    assert any(mtp[0].name in str(p) for p in Container.open(d, strict=False).problems)


def test_biases_the_model_has_no_place_for_are_unknown_and_said(tmp_path: Path) -> None:
    """A router, expert, shared-expert or norm bias (or a correction bias out of its place)
    was classified known and dropped without a word. They are unknown now: not applied (as
    transformers builds these models: the logits do not move), listed by the doctor, and
    Engine.open says so once."""
    import anyio
    from _demo import TINY
    from structlog.testing import capture_logs

    import colibri
    from storage.doctor import run_doctor

    d = Path(shutil.copytree(TINY, tmp_path / "m"))
    rng = np.random.default_rng(5)
    extra = {
        "model.layers.1.mlp.gate.bias": 16,
        "model.layers.1.mlp.experts.0.gate_proj.bias": 96,
        "model.layers.1.mlp.shared_experts.down_proj.bias": 256,
        "model.layers.1.input_layernorm.bias": 256,
        "model.layers.1.self_attn.kv_a_layernorm.bias": 64,
        "model.norm.bias": 256,
        "model.layers.1.mlp.e_score_correction_bias": 16,  # (its place: mlp.gate.)
    }
    arrays = {n: rng.standard_normal(k).astype(np.float32) for n, k in extra.items()}
    specs = [TensorSpec(n, "F32", a.shape) for n, a in arrays.items()]
    write_safetensors(d / "out-extra.safetensors", specs, list(arrays.values()))
    c = Container.open(d)
    assert [n for n in extra if c.entry(n).role is not None] == []
    names = [ch for ch in run_doctor(d).checks if ch.name == "names"]
    assert names and names[0].status == "warn" and "7 tensor name(s)" in names[0].message
    # the indexer's key-norm bias and the router's correction bias stay known
    kept = [
        n
        for n in c.names()
        if n.endswith(("k_norm.bias", "e_score_correction_bias")) and n not in extra
    ]
    assert any("indexer" in n for n in kept) and any("mlp.gate." in n for n in kept)
    assert all(c.entry(n).role is not None for n in kept)

    async def logits(path: Path) -> np.ndarray:
        async with colibri.Engine.open(path) as engine:
            return await engine.forward([1, 2, 3, 4])

    with capture_logs() as logs:
        got = anyio.run(logits, d)
    assert np.array_equal(got, anyio.run(logits, TINY))
    said = [e for e in logs if "does not know" in e["event"]]
    assert len(said) == 1 and said[0]["count"] == 7, logs


def test_a_converted_container_without_its_manifest_reads_the_same_weights(
    tmp_path: Path,
) -> None:
    """The C engine's group rule (gs = I / groups) goes first only for containers colibri did
    not write: a `coli convert` container whose manifest was deleted read its ragged g64
    matrices (96 wide) as g48, other weights and logits, doctor passing."""
    from _demo import TINY

    d = Path(shutil.copytree(TINY, tmp_path / "m"))
    (d / "colibri-manifest.json").unlink()
    a, b = Container.open(TINY), Container.open(d)
    ragged = [n for n in a.names() if (f := a.entry(n).fmt) is not None and f.name == "int4-g64"
              and a.entry(n).shape[1] % 64]  # fmt: skip
    assert ragged  # (what the C rule would read otherwise)
    assert [n for n in a.names() if a.entry(n).fmt != b.entry(n).fmt] == []
    for n in ragged[:3]:
        np.testing.assert_array_equal(a.load_f32(n), b.load_f32(n))
