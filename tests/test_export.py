"""The trained models' Hugging Face export at the end of a run (``nereus.runtime.export``): a write that
fails is one line, the same on every rank, that says how to get the export; the mark records what
the export holds. The export written again on a resume: ``test_runtime_signals``."""

from __future__ import annotations

import errno
from pathlib import Path
from types import SimpleNamespace

import pytest

from nereus.errors import NereusError
from nereus.runtime import comm
from nereus.runtime.export import ACTOR, MARK, export_models, exported, exported_steps

pytestmark = pytest.mark.pure


class _Trainer:
    def __init__(self, fail: OSError | None = None) -> None:
        self.fail = fail
        self.saved: list[Path] = []

    def save_hf(self, directory: Path, companions: object = ()) -> None:
        if self.fail is not None:
            raise self.fail
        directory.mkdir(parents=True)
        self.saved.append(directory)


def test_a_full_disk_is_one_line_and_leaves_no_mark(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(comm, "all_gather", lambda obj, tp: [None, obj])  # this rank's error, rank 1's
    full = _Trainer(OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(NereusError) as err:
        export_models(SimpleNamespace(engines={"actor.train": full}), (), tmp_path, 4, leader=True)
    assert str(err.value) == (
        f"the Hugging Face export to {tmp_path}/hf/actor could not be written (No space left on device); "
        "the checkpoint after step 3 holds the trained actor: resume the run to write it (nereus run "
        "--resume; a launched job: nereus-launch resume)"
    )
    assert exported_steps(tmp_path) is None and (tmp_path / MARK).read_text() == "exporting 4\n"
    assert not exported(tmp_path, 4)  # an export that did not end: a resume writes it


def test_a_peers_failure_is_every_ranks_and_a_written_export_is_marked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(comm, "all_gather", lambda obj, tp: [obj, "rank 1's line"])
    with pytest.raises(NereusError, match=r"^rank 1's line$"):  # this rank wrote nothing: it has no line
        export_models(SimpleNamespace(engines={}), (), tmp_path, 4, leader=False)
    monkeypatch.setattr(comm, "all_gather", lambda obj, tp: [obj])
    trainer = _Trainer()
    export_models(SimpleNamespace(engines={"actor.train": trainer}), (), tmp_path, 4, leader=True)
    assert trainer.saved == [tmp_path / "hf" / "actor"] and exported_steps(tmp_path) == 4
    assert exported(tmp_path, 4) and not exported(tmp_path, 5)  # trained further: not exported yet
    (tmp_path / MARK).write_text("four\n")
    assert exported_steps(tmp_path) is None and not exported(tmp_path, 4)  # unreadable: written again


def test_a_run_from_before_the_mark_counts_as_exported(tmp_path: Path) -> None:
    assert not exported(tmp_path, 4)
    (tmp_path / ACTOR).mkdir(parents=True)
    (tmp_path / ACTOR / "config.json").write_text("{}")
    assert exported(tmp_path, 4)


def test_a_mark_the_leader_cannot_write_is_told_after_the_collective_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The leader joins the collective save even when its mark fails (its peers would wait for
    it), then every rank gets the line."""
    monkeypatch.setattr(comm, "all_gather", lambda obj, tp: [obj])
    (tmp_path / "hf").write_text("a file where the export's folder goes")
    trainer = _Trainer()
    monkeypatch.setattr(trainer, "save_hf", lambda directory, companions=(): trainer.saved.append(directory))
    with pytest.raises(NereusError, match=r"hf/\.exported: "):
        export_models(SimpleNamespace(engines={"actor.train": trainer}), (), tmp_path, 4, leader=True)
    assert trainer.saved == [tmp_path / "hf" / "actor"]  # it took part in the save


def test_a_ppo_run_exports_its_critic_after_its_actor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both trainers' exports, in one order on every rank (each is a collective); a critic that
    cannot be written names its own folder and what the checkpoint holds."""
    monkeypatch.setattr(comm, "all_gather", lambda obj, tp: [obj])
    order: list[Path] = []
    actor, critic = _Trainer(), _Trainer()
    monkeypatch.setattr(actor, "save_hf", lambda directory, companions=(): order.append(directory))
    monkeypatch.setattr(critic, "save_hf", lambda directory, companions=(): order.append(directory))
    engines = {"critic.train": critic, "actor.train": actor, "ref.inf": _Trainer()}
    export_models(SimpleNamespace(engines=engines), (), tmp_path, 2, leader=True)
    assert order == [tmp_path / "hf" / "actor", tmp_path / "hf" / "critic"] and exported(tmp_path, 2)
    broken = _Trainer(OSError(errno.EACCES, "Permission denied"))
    with pytest.raises(NereusError, match=r"/hf/critic could not be written .*holds the trained critic"):
        export_models(SimpleNamespace(engines={"critic.train": broken}), (), tmp_path, 3, leader=True)
