"""convert.py streams: the loader makes a tensor only when the saver asks for it and keeps
none, the saver writes one file at a time, and releasing the source files (after every
file, and after every SOURCE_BYTES read) changes no byte of the output. Host memory is
measured by tools/benchmarks/parts/convert_memory.py; here what is resident is counted, which
does not depend on the machine."""

from __future__ import annotations

import hashlib
import os
import weakref

import pytest
import torch

from megatron_lsgd.training.checkpointing import full_model, hf_io, lazy_tensors
from tools.checkpoint.convert import main as convert


def _tree(path: str) -> dict:
    out = {}
    for base, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(base, f), "rb") as fh:
                out[os.path.relpath(os.path.join(base, f), path)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def _lsgd(src: str, dst: str, tp: int, pp: int, *extra: str) -> list:
    return ["--model-type", "GPT", "--loader", "lsgd", "--saver", "lsgd", "--load-dir", src, "--save-dir", dst,
            "--target-tensor-parallel-size", str(tp), "--target-pipeline-parallel-size", str(pp), *extra]


class _Resident:
    """Every tensor a LazyTensors made, by weak reference; at each file written, the bytes
    of those still alive, but for the open source files' own (memory-mapped) tensors."""

    def __init__(self, monkeypatch):
        self.made = []
        self.at_write = []  # (file, bytes of made tensors alive, bytes of the file's tensors)
        self.largest = 0
        self.open_files = []
        get = lazy_tensors.LazyTensors.__getitem__
        init = lazy_tensors.OpenFiles.__init__

        def register(files, *args, **kwargs):
            init(files, *args, **kwargs)
            self.open_files.append(files)

        monkeypatch.setattr(lazy_tensors.OpenFiles, "__init__", register)

        def traced(mapping, name):
            t = get(mapping, name)
            self.made.append(weakref.ref(t))
            self.largest = max(self.largest, t.numel() * t.element_size())
            return t

        monkeypatch.setattr(lazy_tensors.LazyTensors, "__getitem__", traced)
        for module in (full_model, hf_io):
            self._trace_writer(monkeypatch, module)

    def _trace_writer(self, monkeypatch, module):
        if module is full_model:
            real = full_model.save_file

            def save_file(state, path, what):
                self._record(path, state)
                return real(state, path, what)
            monkeypatch.setattr(full_model, "save_file", save_file)
        else:
            import safetensors.torch as st
            real_st = st.save_file

            def st_save(tensors, path, metadata=None):
                self._record(path, tensors)
                return real_st(tensors, path, metadata=metadata)
            monkeypatch.setattr(st, "save_file", st_save)

    def _record(self, path, content):
        mapped = {id(t) for files in self.open_files for state in files._torch.values() for t in _tensors(state)}
        alive = {id(t): t for t in (r() for r in self.made) if t is not None and id(t) not in mapped}
        live = sum(t.numel() * t.element_size() for t in alive.values())
        self.at_write.append((path, live, _tensor_bytes(content)))


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


@pytest.mark.parametrize("saver", ["lsgd", "hf"])
def test_the_loader_keeps_no_tensor_and_the_saver_one_file(ckpt, tmp_path, monkeypatch, capsys, saver):
    """While each file is written, at most one tensor the loader made is still alive (the
    one it keeps for the next request: Hugging Face's q, k and v come from one fused
    tensor), however many files came before; the file holds only its own slot's tensors."""
    resident = _Resident(monkeypatch)
    if saver == "lsgd":  # TP1 -> TP2 x PP2 with the optimizer state: 8 files of one site
        argv = _lsgd(ckpt, str(tmp_path / "out"), 2, 2)
    else:  # one shard per tensor or so
        argv = ["--model-type", "GPT", "--loader", "lsgd", "--saver", "hf", "--load-dir", ckpt,
                "--save-dir", str(tmp_path / "out"), "--max-shard-size", "20KB"]
    assert convert(argv) == 0, capsys.readouterr().err
    writes = resident.at_write
    assert len(writes) >= 8 and len(resident.made) > 20
    total = sum(content for _, _, content in writes)
    assert total >= 3.9 * lazy_tensors.numel_of(full_model.read_lsgd(ckpt).params)  # fp32 (HF: the true vocabulary)
    for path, live, content in writes:
        assert live <= resident.largest, f"{path}: {live} bytes of source tensors alive"
        assert content <= total / 4, f"{path} holds {content} of the {total} bytes written"


def test_releasing_the_source_after_every_tensor_changes_no_byte(ckpt, tmp_path, monkeypatch, capsys):
    """Source files released and opened again between any two tensors (SOURCE_BYTES = 1)
    give the bytes of the default conversion."""
    default, every = str(tmp_path / "default"), str(tmp_path / "every")
    assert convert(_lsgd(ckpt, default, 2, 2)) == 0
    instances = []
    init = lazy_tensors.OpenFiles.__init__

    def register(files, *args, **kwargs):
        init(files, *args, **kwargs)
        instances.append(files)
    monkeypatch.setattr(lazy_tensors.OpenFiles, "__init__", register)
    monkeypatch.setattr(lazy_tensors, "SOURCE_BYTES", 1)
    assert convert(_lsgd(ckpt, every, 2, 2)) == 0, capsys.readouterr().err
    assert sum(files.opened for files in instances) > 50  # 2 source files, opened again for every tensor
    default_files, every_files = _tree(default), _tree(every)
    assert len(default_files) == 10  # 4 slots x (model, optimizer), metadata.json, the tracker
    assert default_files == every_files


def test_a_large_export_is_written_in_shards_transformers_loads(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from tests.unit_tests.checkpointing.test_convert_hf import _random_hf_model, _theirs

    hf_in, ckpt = str(tmp_path / "hf_in"), str(tmp_path / "ckpt")
    one, shards = str(tmp_path / "one"), str(tmp_path / "shards")
    _random_hf_model("llama").save_pretrained(hf_in)
    assert convert(["--model-type", "GPT", "--loader", "hf", "--saver", "lsgd", "--load-dir", hf_in,
                    "--save-dir", ckpt]) == 0
    export = ["--model-type", "GPT", "--loader", "lsgd", "--saver", "hf", "--load-dir", ckpt]
    assert convert(export + ["--save-dir", one]) == 0
    assert convert(export + ["--save-dir", shards, "--max-shard-size", "100KB"]) == 0
    assert sorted(os.listdir(one)) == ["config.json", "model.safetensors"]
    files = sorted(f for f in os.listdir(shards) if f.endswith(".safetensors"))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert all(os.path.getsize(os.path.join(shards, f)) < 200_000 for f in files)
    assert os.path.isfile(os.path.join(shards, "model.safetensors.index.json"))
    torch.testing.assert_close(_theirs(shards), _theirs(one), rtol=0, atol=0)
    assert isinstance(transformers.AutoConfig.from_pretrained(shards), transformers.LlamaConfig)

    back = str(tmp_path / "back")  # the shards import as the single file does
    assert convert(["--model-type", "GPT", "--loader", "hf", "--saver", "lsgd", "--load-dir", shards,
                    "--save-dir", back]) == 0
    a, b = full_model.read_lsgd(ckpt).params, full_model.read_lsgd(back).params
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    code = convert(export + ["--save-dir", str(tmp_path / "x"), "--max-shard-size", "lots"])
    err = capsys.readouterr().err
    assert code == 2 and "error: --max-shard-size 'lots': expected a size such as 5GB" in err
    assert not os.path.exists(tmp_path / "x")
