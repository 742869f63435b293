"""Where a model's compiled decoder is kept (seq2seq/inference/kept.py), and how `compiled` picks it
(inference/preparation.py): a kept package where one is, eager where none is (auto), built where asked (True)."""

import json

import pytest
import torch

from seq2seq.inference import kept
from seq2seq.inference.preparation import prepare
from seq2seq.model import Transformer, TransformerConfig
from seq2seq.model.compiled import ALL_KINDS, CompiledDecoder, kind_name
from seq2seq.model.packaged import FORMAT, MANIFEST
from seq2seq.precision import verdict_cache


def model(*, seed: int = 0, **variant) -> Transformer:
    torch.manual_seed(seed)
    config = TransformerConfig(**{**dict(vocab_size=40, d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1,
                                         num_decoder_layers=1, max_positions=32), **variant})
    return Transformer(config).eval()


def fake_package(folder) -> None:
    folder.mkdir(parents=True)
    files = {kind_name(kind): kind_name(kind) for kind in ALL_KINDS}
    for name in files.values():
        (folder / name).mkdir()
        (folder / name / "wrapper.so").write_bytes(b"not a package")
    (folder / MANIFEST).write_text(json.dumps({"format": FORMAT, "torch": torch.__version__, "threads": 1,
                                               "files": files, "attention_kernel": None}))


def test_a_package_is_keyed_by_the_weights_the_precision_and_the_threads_in_the_machines_folder():
    folder = kept.package_folder(model(), precision="fp32", threads=1)
    assert folder.parent == verdict_cache() / "compiled"  # (the CPU's model and flags, torch's version)
    assert kept.package_folder(model(), precision="fp32", threads=1) == folder  # (the same weights loaded again)
    changed = model()
    with torch.no_grad():
        changed.decoder.layers[0].ffn.w_out.weight[0, 0] += 1e-3  # (one weight, trained a step further)
    others = [kept.package_folder(changed, precision="fp32", threads=1),
              kept.package_folder(model(), precision="bf16", threads=1),
              kept.package_folder(model(), precision="fp32", threads=2),
              kept.package_folder(model(activation="gelu"), precision="fp32", threads=1)]
    assert len({folder, *others}) == 5
    named = kept.package_folder(model(), precision="fp32", threads=1, checksum="ab" * 32)  # (a checkpoint's)
    assert named == kept.package_folder(changed, precision="fp32", threads=1, checksum="ab" * 32)  # (stands for them)
    assert len({folder, named, kept.package_folder(model(), precision="fp32", threads=1, checksum="cd" * 32)}) == 3


def test_only_cpu_fp32_or_bf16_models_with_absolute_positions_are_packaged():
    cpu = torch.device("cpu")
    assert kept.packageable(model(), device=cpu, precision="fp32")
    assert kept.packageable(model(positions="learned"), device=cpu, precision="bf16")
    assert not kept.packageable(model(), device=cpu, precision="int8")
    assert not kept.packageable(model(positions="rotary"), device=cpu, precision="fp32")
    assert not kept.packageable(model(), device=torch.device("cuda"), precision="bf16")


def test_auto_decodes_eager_where_nothing_is_kept_and_names_where_it_would_be():
    prepared = prepare(model(), precision="fp32", compiled="auto")
    assert (prepared.compiled, prepared.package) == (False, None) and prepared.decoding is prepared.model
    assert prepared.kept_at == kept.package_folder(model(), precision="fp32", threads=1)
    assert prepare(model(), precision="fp32", compiled=False).kept_at is None  # (off: nothing looked for)


def test_auto_and_true_take_the_kept_package_and_jit_and_int8_compile_in_the_process():
    """A package kept for the model, precision and threads: auto takes it (the Translator loads it); jit compiles
    with torch.compile whatever is kept, as True does for int8, which no package holds."""
    fake_package(kept.package_folder(model(), precision="fp32", threads=2))
    prepared = prepare(model(), precision="fp32", compiled="auto", threads=2)
    assert prepared.compiled and prepared.package == prepared.kept_at
    assert isinstance(prepared.decoding, CompiledDecoder)
    assert prepare(model(), precision="fp32", compiled="auto", threads=1).package is None  # (another count)
    for compiled, precision in (("jit", "fp32"), (True, "int8")):
        prepared = prepare(model(), precision=precision, compiled=compiled, threads=2)
        assert prepared.compiled and prepared.package is None and isinstance(prepared.decoding, CompiledDecoder)


def test_a_kept_package_that_does_not_load_is_built_again(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """kept_decoder: a package there but damaged (a file of it half written by a full disk, say) is removed and built
    again, with a line saying so; one that loads is not built."""
    decoder = CompiledDecoder(model(), gemm_templates=False)
    uncompiled = {kind: decoder.uncompiled(str(kind[0])) for kind in ALL_KINDS}
    built: list = []

    def build(decoder, folder, *, progress):
        built.append(folder)
        fake_package(folder)
        (folder / "loads").touch()

    def load(folder, *, runners):
        if not (folder / "loads").exists():
            raise kept.PackageError(f"{folder}: the compiled package could not be loaded (damaged)")
        return uncompiled

    monkeypatch.setattr(kept, "build_package", build)
    monkeypatch.setattr(kept, "load_package", load)
    fake_package(tmp_path / "package")
    lines: list[str] = []
    with_package = kept.kept_decoder(decoder, tmp_path / "package", runners=1, progress=lines.append)
    assert with_package.packaged == uncompiled and built == [tmp_path / "package"]
    assert lines == [f"{tmp_path / 'package'}: the compiled package could not be loaded (damaged): compiling it again"]
    kept.kept_decoder(decoder, tmp_path / "package", runners=1)
    assert built == [tmp_path / "package"]  # (it loads now: not built again)
