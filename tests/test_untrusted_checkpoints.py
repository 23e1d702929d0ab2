"""A checkpoint is data: a payload planted in ``meta.pt``, DCP's ``.metadata``, a pickled DCP object or a ``.ckpt``
file never runs on any load path, and the refusal names the file and the type; checkpoints of every format the
project wrote still load; and every resume verifies checksums by default.

One process throughout (world size 1): the loads are the same functions at any world size. The payload is a
``__reduce__`` that returns ``(open, (marker, "w"))``: unpickling it creates the marker file.
"""

from __future__ import annotations

import ast
import datetime
import io
import pickle
import pickletools
import shutil
import zipfile
from pathlib import Path
from typing import Any, Callable

import lightning as L
from lightning.fabric.utilities.data import AttributeDict
import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch._weights_only_unpickler import Unpickler as WeightsUnpickler
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

import lightning_zero
from lightning_zero import CheckpointError, ZeroCheckpointIO, ZeroEngine
from lightning_zero.checkpoints.staging import describe, write_meta_digest
from lightning_zero.checkpoints.storage import KEY
from lightning_zero.checkpoints.trust import UntrustedCheckpointError, torch_load
from lightning_zero.cli import main as cli
from lightning_zero.engine import state as engine_state
from lightning_zero.testing.launch import launch
from tests.checkpoint_fixtures import HPARAMS, Regressor, write_fabric_checkpoint, write_trainer_checkpoint

FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints"
#: Checkpoints written by the package at commit ff68078 (the first with ``meta.crc32``; before ``whole_params``).
OLD = FIXTURES / "ff68078"
REFUSED = "io.open"  # `open`, as pickle names it


class Payload:
    """Creates ``marker`` when unpickled: what an attacker's ``os.system`` would do, visibly."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


# ---------------------------------------------------------------------- checkpoints, good and bad
@pytest.fixture(scope="module")
def current(tmp_path_factory) -> dict[str, Path]:
    """The checkpoints of tests/checkpoint_fixtures.py written by this package."""
    out = tmp_path_factory.mktemp("current")
    return {"trainer": write_trainer_checkpoint(out), "fabric": write_fabric_checkpoint(out)}


def _copy(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def _trusted_meta(path: Path) -> dict[str, Any]:
    return torch.load(path / "meta.pt", weights_only=False)


def _rewrite(path: Path, meta: dict[str, Any]) -> None:
    """Write ``meta`` as ``meta.pt`` with every checksum recomputed, as an attacker would."""
    for name in meta[KEY]["files"]:
        meta[KEY]["files"][name] = describe(path / name)
    with open(path / "meta.pt", "wb") as f:
        torch.save(meta, f)
    write_meta_digest(path, path / "meta.pt")


def evil_meta(source: Path, target: Path, marker: Path) -> Path:
    path = _copy(source, target)
    meta = _trusted_meta(path)
    meta["hyper_parameters" if "hyper_parameters" in meta else "step"] = {"width": 4, "evil": Payload(marker)}
    _rewrite(path, meta)
    return path


def evil_metadata(source: Path, target: Path, marker: Path) -> Path:
    """The payload in DCP's index; ``meta.pt`` also claims to be trusted, which must change nothing."""
    path = _copy(source, target)
    with open(path / ".metadata", "rb") as f:
        index = pickle.load(f)
    index.planner_data = Payload(marker)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(index, f)
    meta = _trusted_meta(path)
    meta[KEY]["trusted"] = True
    _rewrite(path, meta)
    return path


def evil_object(source: Path, target: Path, marker: Path) -> Path:
    """An optimizer state turned into a pickled DCP object (appended to the shard file) holding the payload."""
    path = _copy(source, target)
    key = "optimizer/0/0/step"
    blob = io.BytesIO()
    torch.save(Payload(marker), blob)
    shard = path / "__0_0.distcp"
    offset = shard.stat().st_size
    shard.write_bytes(shard.read_bytes() + blob.getvalue())
    with open(path / ".metadata", "rb") as f:
        index = pickle.load(f)
    index.state_dict_metadata[key] = BytesStorageMetadata()
    for item in [i for i in index.storage_data if i.fqn == key]:
        del index.storage_data[item]
    index.storage_data[MetadataIndex(key)] = _StorageInfo("__0_0.distcp", offset, len(blob.getvalue()))
    with open(path / ".metadata", "wb") as f:
        pickle.dump(index, f)
    meta = _trusted_meta(path)
    meta[KEY]["tensors"][key] = None
    _rewrite(path, meta)
    return path


def evil_file(source: Path, target: Path, marker: Path) -> Path:
    """An ordinary Lightning ``.ckpt`` file (the consolidated checkpoint) with the payload in its hyperparameters."""
    checkpoint = lightning_zero.load_full_checkpoint(source)
    checkpoint["hyper_parameters"] = {"width": 4, "evil": Payload(marker)}
    torch.save(checkpoint, target)
    return target


# ---------------------------------------------------------------------- every load path
def _trainer(strategy: Any = "zero3", **kwargs: Any) -> L.Trainer:
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=3, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs)


def _fabric_model(stage: int = 2) -> tuple[L.Fabric, Any, Any]:
    fabric = L.Fabric(strategy=f"zero{stage}", accelerator="cpu", devices=1)
    fabric.launch()
    model = Regressor(**HPARAMS)
    return fabric, *fabric.setup(model, torch.optim.Adam(model.parameters(), lr=0.05))


def _fabric_load_not_set_up(path: Path) -> None:
    """``fabric.load`` into a model that was never set up (read as ``ddp`` reads it: consolidated for a directory)."""
    fabric = L.Fabric(strategy="zero2", accelerator="cpu", devices=1)
    fabric.launch()
    fabric.load(path, {"model": Regressor(**HPARAMS)}, strict=False)


def _engine_load(path: Path) -> None:
    model = Regressor(**HPARAMS)
    engine = ZeroEngine(model, [torch.optim.Adam(model.parameters(), lr=0.05)], stage=2)
    checkpoint = engine_state.read(path)
    engine_state.load_model(engine, checkpoint)
    engine_state.load_optimizers(engine, checkpoint)


def _cli(*args: str) -> None:
    """The command, raising its error as the exception it printed (exit status 2)."""
    import contextlib

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = cli(list(args))
    if status != 0:
        raise CheckpointError(err.getvalue())


def _fabric_load(path: Path) -> None:
    fabric, model, optimizer = _fabric_model()
    fabric.load(path, {"model": model, "optimizer": optimizer})


LOADS: dict[str, Callable[[Path, Path], Any]] = {
    "cli inspect": lambda p, tmp: _cli("inspect", str(p)),
    "cli inspect --verify": lambda p, tmp: _cli("inspect", str(p), "--verify"),
    "cli consolidate": lambda p, tmp: _cli("consolidate", str(p), str(tmp / "out.ckpt")),
    "inspect_checkpoint": lambda p, tmp: lightning_zero.inspect_checkpoint(p, verify=True),
    "load_full_checkpoint": lambda p, tmp: lightning_zero.load_full_checkpoint(p),
    "lightning_zero.load_from_checkpoint": lambda p, tmp: lightning_zero.load_from_checkpoint(Regressor, p),
    "MyModule.load_from_checkpoint": lambda p, tmp: Regressor.load_from_checkpoint(p),
    "MyModule.load_from_checkpoint weights_only=True": lambda p, tmp: Regressor.load_from_checkpoint(
        p, weights_only=True),
    "Trainer resume zero3": lambda p, tmp: _trainer().fit(Regressor(**HPARAMS), ckpt_path=p),
    "Trainer resume zero3 weights_only=True": lambda p, tmp: _trainer().fit(Regressor(**HPARAMS), ckpt_path=p,
                                                                           weights_only=True),
    "Trainer resume ddp-form (pl_load)": lambda p, tmp: _trainer("auto").fit(Regressor(**HPARAMS), ckpt_path=p),
    "Trainer resume ZeroCheckpointIO": lambda p, tmp: _trainer("auto", plugins=[ZeroCheckpointIO()]).fit(
        Regressor(**HPARAMS), ckpt_path=p),
    "Fabric load": lambda p, tmp: _fabric_load(p),
    "Fabric load (no state)": lambda p, tmp: _fabric_model()[0].load(p),
    "Fabric load (model not set up)": lambda p, tmp: _fabric_load_not_set_up(p),
    "ZeroEngine load": lambda p, tmp: _engine_load(p),
    "export_pretrained": lambda p, tmp: lightning_zero.export_pretrained(p, tmp / "exported"),
}
#: The loads that never unpickle ``.metadata`` (they read ``meta.pt`` and check file sizes and checksums) and those
#: that read the model only (not the optimizer's objects): a payload there is never reached.
NO_METADATA = {"cli inspect", "cli inspect --verify", "inspect_checkpoint"}
NO_OBJECTS = NO_METADATA | {"lightning_zero.load_from_checkpoint", "export_pretrained"}
BUILDERS = {"meta.pt": evil_meta, ".metadata": evil_metadata, "object": evil_object}


@pytest.mark.parametrize("load", sorted(LOADS))
@pytest.mark.parametrize("where", sorted(BUILDERS))
def test_a_payload_in_a_checkpoint_directory_never_runs(current, tmp_path, where, load):
    marker = tmp_path / "PAYLOAD-RAN"
    path = BUILDERS[where](current["trainer"], tmp_path / "evil.ckpt", marker)
    unreached = (where == ".metadata" and load in NO_METADATA) or (where == "object" and load in NO_OBJECTS)
    if unreached:
        LOADS[load](path, tmp_path)
    else:
        with pytest.raises(CheckpointError) as refusal:
            LOADS[load](path, tmp_path)
        message = str(refusal.value)
        named = {"meta.pt": str(path / "meta.pt"), ".metadata": str(path / ".metadata"),
                 "object": f"{path} (its object 'optimizer/0/0/step'"}[where]
        assert named in message and REFUSED in message and "weights_only=False" in message, message
    assert not marker.exists(), f"the payload ran on `{load}`"


def test_at_two_ranks_every_rank_refuses_the_payload(current, tmp_path):
    """A resume at 2 ranks (DCP coordinating the ranks' plans over the process group): every rank raises the refusal
    that names the file and the type, and the payload runs nowhere."""
    marker = tmp_path / "PAYLOAD-RAN"
    paths = [evil_metadata(current["trainer"], tmp_path / "metadata.ckpt", marker),
             evil_object(current["trainer"], tmp_path / "object.ckpt", marker)]
    for rank, reports in enumerate(launch("untrusted.py", 2, tmp_path, args=tuple(map(str, paths)), timeout=300)):
        for path, where in zip(paths, (str(paths[0] / ".metadata"), f"{paths[1]} (its object 'optimizer/0/0/step'")):
            report = reports[path.name]
            assert report["type"] in ("UntrustedCheckpointError", "CheckpointError"), (rank, report)
            assert where in report["message"] and REFUSED in report["message"], (rank, report)
    assert not marker.exists()


FILE_LOADS: dict[str, Callable[[Path, Path], Any]] = {
    "cli inspect": LOADS["cli inspect"],
    "inspect_checkpoint": lambda p, tmp: lightning_zero.inspect_checkpoint(p),
    "MyModule.load_from_checkpoint": LOADS["MyModule.load_from_checkpoint"],
    "lightning_zero.load_from_checkpoint": LOADS["lightning_zero.load_from_checkpoint"],
    "Trainer resume zero3": LOADS["Trainer resume zero3"],
    "Trainer resume ddp-form": LOADS["Trainer resume ddp-form (pl_load)"],
    "Fabric load": LOADS["Fabric load"],
    "Fabric load (no state)": LOADS["Fabric load (no state)"],
    "ZeroEngine load": LOADS["ZeroEngine load"],
    "load_pretrained": lambda p, tmp: lightning_zero.load_pretrained(Regressor(**HPARAMS), p),
    "export_pretrained": LOADS["export_pretrained"],
}
#: Loads where torch (through Lightning) reads the file itself, with its own error (``weights_only=True``).
TORCH_READS = {"MyModule.load_from_checkpoint", "lightning_zero.load_from_checkpoint", "Trainer resume zero3",
               "Trainer resume ddp-form", "Fabric load (no state)"}


@pytest.mark.parametrize("load", sorted(FILE_LOADS))
def test_a_payload_in_a_checkpoint_file_never_runs(current, tmp_path, load):
    marker = tmp_path / "PAYLOAD-RAN"
    path = evil_file(current["trainer"], tmp_path / "evil.ckpt", marker)
    with pytest.raises((CheckpointError, pickle.UnpicklingError, ValueError)) as refusal:
        FILE_LOADS[load](path, tmp_path)
    message = str(refusal.value)
    assert REFUSED in message, message
    if load not in TORCH_READS:
        hint = "state dict of tensors only" if load == "load_pretrained" else "weights_only=False"
        assert str(path) in message and hint in message, message
    assert not marker.exists(), f"the payload ran on `{load}`"


# ---------------------------------------------------------------------- callables of torch and the standard library
def pickled_call(module: str, name: str, *args: Any) -> bytes:
    """A pickle that calls ``module.name(*args)`` when it is read, naming it exactly so (``GLOBAL module name``, as
    an attacker writes it by hand: ``torch save`` rather than the ``torch.serialization save`` pickle would write)."""
    arguments = pickletools.optimize(pickle.dumps(args, protocol=2))[2:-1]  # no memo: it may be spliced in
    return b"\x80\x02c" + f"{module}\n{name}\n".encode() + arguments + b"R."


#: Callables a payload may name, with the arguments that make their running visible (a file created, the seed of
#: the default generator changed) or, for the others, harmless ones: every one is refused by torch's own
#: weights-only reader, and none may run on any of our loads.
CALLS: dict[tuple[str, str], Callable[[Path], tuple[Any, ...]]] = {
    ("torch", "save"): lambda marker: ([], str(marker)),
    ("torch.serialization", "save"): lambda marker: ([], str(marker)),
    ("torch", "manual_seed"): lambda marker: (1234,),
    ("torch", "load"): lambda marker: (str(marker),),
    ("torch", "Size.__reduce_ex__"): lambda marker: (2,),
    ("builtins", "eval"): lambda marker: (f"open({str(marker)!r}, 'w')",),
    ("os", "system"): lambda marker: (f"touch {marker}",),
    ("pathlib", "Path.touch"): lambda marker: (str(marker),),
}


def _assert_nothing_ran(marker: Path, seed: int) -> None:
    assert not marker.exists() and torch.initial_seed() == seed, "the payload ran"


@pytest.mark.parametrize("call", sorted(CALLS), ids=".".join)
def test_the_metadata_reader_refuses_every_callable_torchs_own_reader_refuses(tmp_path, call):
    """DCP's ``.metadata`` admits DCP's classes, ``torch.Size``, dtypes and paths: a callable of ``torch`` beyond
    them, or of the standard library, is refused by name before it runs, as torch's weights-only reader refuses it."""
    from lightning_zero.checkpoints.trust import load_dcp_metadata

    marker, seed = tmp_path / "PAYLOAD-RAN", torch.initial_seed()
    payload = pickled_call(*call, *CALLS[call](marker))
    with pytest.raises(pickle.UnpicklingError, match="(?i)unsupported global"):  # the oracle: not data for torch
        WeightsUnpickler(io.BytesIO(payload)).load()
    with pytest.raises(UntrustedCheckpointError) as refusal:
        load_dcp_metadata(io.BytesIO(payload), tmp_path / ".metadata")
    assert refusal.value.refused == [".".join(call)], refusal.value.refused
    _assert_nothing_ran(marker, seed)
    assert WeightsUnpickler(io.BytesIO(pickled_call("torch", "Size", [2, 3]))).load() == torch.Size([2, 3])


def _index_with(path: Path, payload: bytes) -> None:
    """``path``'s ``.metadata`` with ``payload`` as its planner data (DCP's own index around it)."""
    with open(path / ".metadata", "rb") as f:
        index = pickle.load(f)
    index.planner_data = "PLANNER-DATA"
    blob = pickle.dumps(index, protocol=2)  # no frames: a string's opcode is found as it is
    held = pickle.dumps("PLANNER-DATA", protocol=2)[2:-3]  # its opcode, without its BINPUT and STOP
    assert blob.count(held) == 1
    (path / ".metadata").write_bytes(blob.replace(held, payload[2:-1]))  # the call's result memoized as it was
    _rewrite(path, _trusted_meta(path))  # sizes and checksums to match, as an attacker would


@pytest.mark.parametrize("load", ["load_full_checkpoint", "Trainer resume zero3", "Fabric load", "ZeroEngine load"])
def test_a_torch_callable_in_dcps_index_never_runs(current, tmp_path, load):
    """``torch save`` in ``.metadata``, the rest of DCP's index as DCP wrote it: refused by name on every load that
    reads the index, and nothing ran."""
    marker, seed = tmp_path / "PAYLOAD-RAN", torch.initial_seed()
    path = _copy(current["trainer"], tmp_path / "index.ckpt")
    _index_with(path, pickled_call("torch", "save", [], str(marker)))
    with pytest.raises(CheckpointError) as refusal:
        LOADS[load](path, tmp_path)
    message = str(refusal.value)
    assert str(path / ".metadata") in message and "`torch.save`" in message and "weights_only=False" in message
    _assert_nothing_ran(marker, seed)


# ---------------------------------------------------------------------- a trusted load, explicitly
def _with_a_date(source: Path, target: Path) -> Path:
    """A checkpoint holding a harmless type outside the allow-list (``datetime.date``) in its hyperparameters."""
    path = _copy(source, target)
    meta = _trusted_meta(path)
    meta["hyper_parameters"] = {**meta["hyper_parameters"], "extra": {"since": datetime.date(2024, 1, 1)}}
    _rewrite(path, meta)
    return path


def test_a_type_outside_the_allow_list_loads_only_when_the_user_trusts_that_load(current, tmp_path):
    path = _with_a_date(current["trainer"], tmp_path / "dated.ckpt")
    with pytest.raises(UntrustedCheckpointError, match=r"meta\.pt holds `datetime\.date`") as refusal:
        lightning_zero.load_full_checkpoint(path)
    assert refusal.value.refused == ["datetime.date"] and "--trust-code" in str(refusal.value)
    assert str(pickle.loads(pickle.dumps(refusal.value))) == str(refusal.value)  # it can cross to another rank
    since = datetime.date(2024, 1, 1)
    assert lightning_zero.load_full_checkpoint(path, trust_code=True)["hyper_parameters"]["extra"]["since"] == since
    with pytest.raises(UntrustedCheckpointError):  # the trust was for that one load
        lightning_zero.inspect_checkpoint(path)
    assert cli(["inspect", str(path)]) == 2
    assert cli(["inspect", str(path), "--trust-code"]) == 0
    assert cli(["consolidate", str(path), str(tmp_path / "out.ckpt"), "--trust-code"]) == 0
    assert lightning_zero.load_from_checkpoint(Regressor, path, weights_only=False).hparams.extra["since"] == since
    assert Regressor.load_from_checkpoint(path, weights_only=False).hparams.extra["since"] == since
    trainer = _trainer()
    with pytest.raises(CheckpointError, match=r"meta\.pt holds `datetime\.date`"):  # found before the build
        trainer.fit(Regressor(**HPARAMS), ckpt_path=path)
    trainer = _trainer()
    trainer.fit(Regressor(**HPARAMS), ckpt_path=path, weights_only=False)
    assert trainer.global_step == 3
    consolidated = tmp_path / "out.ckpt"  # a file under zero3: torch reads it, with the trust given to `fit`
    with pytest.raises(pickle.UnpicklingError, match=r"datetime\.date"):
        _trainer().fit(Regressor(**HPARAMS), ckpt_path=consolidated)
    trainer = _trainer()
    trainer.fit(Regressor(**HPARAMS), ckpt_path=consolidated, weights_only=False)
    assert trainer.global_step == 3
    fabric, model, optimizer = _fabric_model()
    assert fabric.load(path, {"model": model, "optimizer": optimizer}, weights_only=False)["global_step"] == 2


def test_lightnings_attribute_dict_in_a_fabric_state_is_refused_by_name(current, tmp_path):
    """torch's weights-only reader fills no ``dict`` subclass: ``model.hparams`` saved as it is needs a trusted load."""
    path = _copy(current["fabric"], tmp_path / "hparams.ckpt")
    meta = _trusted_meta(path)
    meta["hparams"] = AttributeDict(meta["hparams"])
    _rewrite(path, meta)
    fabric, model, optimizer = _fabric_model()
    refused = r"meta\.pt holds `lightning\.fabric\.utilities\.data\.AttributeDict`"
    with pytest.raises(UntrustedCheckpointError, match=refused):
        fabric.load(path, {"model": model, "optimizer": optimizer})
    assert fabric.load(path, {"model": model, "optimizer": optimizer}, weights_only=False)["hparams"] == HPARAMS


# ---------------------------------------------------------------------- every format still loads
def _formats(current: dict[str, Path]) -> dict[str, dict[str, Path]]:
    return {"ff68078": {"trainer": OLD / "trainer-zero3.ckpt", "fabric": OLD / "fabric-zero2.ckpt"}, "current": current}


@pytest.mark.parametrize("version", ["ff68078", "current"])
def test_checkpoints_of_every_format_load_on_every_path(current, tmp_path, version):
    paths = _formats(current)[version]
    trainer_ckpt, fabric_ckpt = paths["trainer"], paths["fabric"]
    reference = torch.load(trainer_ckpt / "meta.pt", weights_only=False)  # the files are ours: trusted here
    full = lightning_zero.load_full_checkpoint(trainer_ckpt)
    assert full["hyper_parameters"] == reference["hyper_parameters"] == HPARAMS
    assert full["callbacks"] == reference["callbacks"] and full["global_step"] == 2
    weights = full["state_dict"]
    for load in ("lightning_zero.load_from_checkpoint", "MyModule.load_from_checkpoint",
                 "MyModule.load_from_checkpoint weights_only=True"):
        model = LOADS[load](trainer_ckpt, tmp_path)
        assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items()), load
    for load in ("cli inspect --verify", "cli consolidate", "ZeroEngine load"):
        LOADS[load](trainer_ckpt, tmp_path)
    consolidated = torch_load(tmp_path / "out.ckpt", tmp_path / "out.ckpt")  # the path in it is admitted
    assert consolidated["state_dict"].keys() == weights.keys() and consolidated["hyper_parameters"] == HPARAMS
    for load in ("Trainer resume zero3", "Trainer resume ddp-form (pl_load)", "Trainer resume ZeroCheckpointIO"):
        trainer = _trainer("zero3" if "zero3" in load else "auto", **(
            {"plugins": [ZeroCheckpointIO()]} if "IO" in load else {}))
        trainer.fit(Regressor(**HPARAMS), ckpt_path=trainer_ckpt)
        assert trainer.global_step == 3, load
    fabric, model, optimizer = _fabric_model()
    rest = fabric.load(fabric_ckpt, {"model": model, "optimizer": optimizer})
    assert rest["hparams"] == HPARAMS and rest["data_dir"] == Path("data") and rest["step"] == 1
    fabric, model, optimizer = _fabric_model(stage=3)
    fabric.load(trainer_ckpt, {"model": model, "optimizer": optimizer})  # a Trainer checkpoint under Fabric
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_the_old_fixture_holds_the_same_weights_as_a_checkpoint_written_now(current):
    """The fixture is the format of its time (no ``whole_params``), and its content is what this package writes."""
    old_meta = torch.load(OLD / "trainer-zero3.ckpt" / "meta.pt", weights_only=False)
    assert "whole_params" not in old_meta[KEY]["optimizers"][0]
    old = lightning_zero.load_full_checkpoint(OLD / "trainer-zero3.ckpt")["state_dict"]
    new = lightning_zero.load_full_checkpoint(current["trainer"])["state_dict"]
    assert old.keys() == new.keys() and all(torch.allclose(old[k], new[k], atol=1e-6) for k in old)


# ---------------------------------------------------------------------- checksums on resume, by default
def _flip_a_tensor_byte(source: Path, target: Path) -> Path:
    """One byte flipped in the middle of a saved tensor's data (the file keeps its size)."""
    path = _copy(source, target)
    with open(path / ".metadata", "rb") as f:
        index = pickle.load(f)
    info = max(index.storage_data.values(), key=lambda i: i.length)  # one torch.save'd tensor, a zip archive
    data = bytearray((path / info.relative_path).read_bytes())
    item = zipfile.ZipFile(io.BytesIO(bytes(data[info.offset: info.offset + info.length])))
    record = next(r for r in item.infolist() if r.filename.endswith("/data/0"))
    header = bytes(data[info.offset + record.header_offset: info.offset + record.header_offset + 30])
    start = record.header_offset + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30],
                                                                                                 "little")
    data[info.offset + start + record.file_size // 2] ^= 0x01  # the middle of the tensor's bytes
    (path / info.relative_path).write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("load", ["Trainer resume zero3", "Fabric load", "Fabric load (no state)", "ZeroEngine load",
                                  "load_full_checkpoint"])
def test_a_flipped_byte_in_a_shard_is_refused_by_default(current, tmp_path, load):
    path = _flip_a_tensor_byte(current["trainer"], tmp_path / "flipped.ckpt")
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        LOADS[load](path, tmp_path)


# ---------------------------------------------------------------------- one door
def test_every_unpickling_in_the_package_goes_through_trust_py():
    """A new load path cannot bypass the allow-list: ``torch.load``, ``pickle``'s loaders and DCP's reader are called
    in ``checkpoints/trust.py`` only, and ``dcp.load`` in ``storage.py`` only, with the reader of ``trust.py``."""
    package = Path(__file__).resolve().parent.parent / "lightning_zero"
    calls = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = ast.unparse(node.func)
                if name in ("torch.load", "pickle.load", "pickle.loads", "pickle.Unpickler", "dcp.FileSystemReader",
                            "FileSystemReader", "dcp.load", "torch.distributed.checkpoint.load"):
                    calls.append((path.relative_to(package).as_posix(), name, ast.unparse(node)))
    outside = [c for c in calls if c[0] != "checkpoints/trust.py" and c[1] != "dcp.load"]
    assert not outside, outside
    loads = [c for c in calls if c[1] == "dcp.load"]
    assert [c[0] for c in loads] == ["checkpoints/storage.py"] and "storage_reader=reader" in loads[0][2], loads
