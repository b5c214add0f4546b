"""Checkpoints are pickles: kvsched loads only those it wrote (a keyed SHA-256 beside them) or
shipped, unless --trust-checkpoint; damaged checkpoints and metadata give one-line errors."""

from __future__ import annotations

import base64
import io
import json
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest

from kvsched.agents import trust
from kvsched.agents.shipped_checkpoints import SHIPPED_SHA256
from kvsched.envs.sim.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_PPO = ROOT / "agents" / "checkpoints" / "scheduling_maskable_ppo.zip"


class _Payload:
    """Unpickling this writes a marker file: what a crafted checkpoint could do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "code ran"))


def crafted_checkpoint(folder: Path, marker: Path) -> Path:
    """An SB3-style zip whose ``data`` holds a serialized object that runs code when loaded, with
    training metadata beside it (as a download would come)."""
    ckpt = folder / "crafted.zip"
    blob = base64.b64encode(pickle.dumps(_Payload(marker))).decode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("data", json.dumps({"policy_class": {":type:": "x", ":serialized:": blob}}))
    ckpt.write_bytes(buf.getvalue())
    (folder / "crafted.json").write_text(json.dumps({"env_id": "kvsched/Scheduling-v0", "algo": "maskable_ppo",
                                                     "env_kwargs": {}}))
    return ckpt


def test_every_shipped_checkpoint_is_listed_and_trusted_without_a_flag():
    found = sorted(p.relative_to(ROOT).as_posix() for base in (ROOT / "agents" / "checkpoints",
                                                               ROOT / "experiments" / "suite" / "results")
                   for p in base.rglob("*.zip"))
    assert found and found == sorted(SHIPPED_SHA256), "regenerate agents/shipped_checkpoints.py"
    for rel in found:
        assert trust.digest(ROOT / rel) == SHIPPED_SHA256[rel], rel
        trust.check(ROOT / rel)  # no ConfigError


def test_evaluate_refuses_a_crafted_checkpoint_before_loading_it(tmp_path, capsys):
    from kvsched.experiments.cli import main

    marker = tmp_path / "pwned"
    ckpt = crafted_checkpoint(tmp_path, marker)
    code = main(["evaluate", "--agents", f"{ckpt},fcfs", "--windows", "1", "--seeds", "1",
                 "--out", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "is not one kvsched wrote" in err and "--trust-checkpoint" in err and "unpickles" in err
    assert len(err.strip().splitlines()) == 1 and not marker.exists()


def test_a_sidecar_someone_else_made_or_a_changed_file_is_refused(tmp_path, monkeypatch):
    ckpt = tmp_path / "final.zip"
    shutil.copyfile(SHIPPED_PPO, ckpt)
    ckpt.write_bytes(ckpt.read_bytes() + b"\0")  # not the shipped content any more
    with pytest.raises(ConfigError, match="no final.zip.sha256 beside it"):
        trust.check(ckpt)
    trust.record(ckpt)
    trust.check(ckpt)  # kvsched wrote it: loads without a flag
    # the same sidecar under another user's key (or one made by hand) does not pass
    monkeypatch.setenv(trust.KEY_ENV, str(tmp_path / "other.key"))
    with pytest.raises(ConfigError, match="not written by kvsched under this user's key"):
        trust.check(ckpt)
    trust.record(ckpt)
    forged = json.loads(trust.sidecar(ckpt).read_text())
    ckpt.write_bytes(ckpt.read_bytes() + b"more")
    with pytest.raises(ConfigError, match="changed after kvsched wrote it"):
        trust.check(ckpt)
    forged["sha256"] = trust.digest(ckpt)  # a matching SHA-256 without the key's HMAC
    trust.sidecar(ckpt).write_text(json.dumps(forged))
    with pytest.raises(ConfigError, match="not written by kvsched under this user's key"):
        trust.check(ckpt)
    trust.check(ckpt, trust=True)  # --trust-checkpoint


def test_checkpoints_kvsched_writes_get_their_sidecar(tmp_path):
    from kvsched.agents.es import LinearScheduler

    path = tmp_path / "es.zip"
    sched = LinearScheduler.load(ROOT / "agents" / "checkpoints" / "bench-v1" / "es-overload-burst-s0.zip")
    sched.save(path)
    trust.check(path)
    assert json.loads(trust.sidecar(path).read_text())["sha256"] == trust.digest(path)
    folder = tmp_path / "checkpoint"  # an RLlib checkpoint is a folder
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "module.pt").write_bytes(b"weights")
    trust.record(folder)
    trust.check(folder)
    (folder / "sub" / "extra.pkl").write_bytes(b"added later")
    with pytest.raises(ConfigError, match="changed after kvsched wrote it"):
        trust.check(folder)


def test_train_resume_refuses_an_untrusted_checkpoint_and_a_half_written_one_cleanly(tmp_path):
    pytest.importorskip("sb3_contrib")
    from kvsched.agents.train import train

    half = tmp_path / "final.zip"
    shutil.copyfile(SHIPPED_PPO, half)
    trust.record(half)  # kvsched wrote it ... then a crash cut a rewrite short
    half.write_bytes(SHIPPED_PPO.read_bytes()[:60_000])
    kw = dict(timesteps=64, out=tmp_path / "o", resume=half, progress_bar=False)
    with pytest.raises(ConfigError, match="changed after kvsched wrote it"):
        train("kvsched/Scheduling-v0", "maskable_ppo", **kw)
    with pytest.raises(ConfigError, match=r"--resume .*final.zip.* is damaged \(") as e:
        train("kvsched/Scheduling-v0", "maskable_ppo", trust_checkpoint=True, **kw)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("meta, key", [({"algo": "es", "env_kwargs": {}}, "env_id"),
                                       ({"env_id": "kvsched/Scheduling-v0", "env_kwargs": {}}, "algo"),
                                       ({"env_id": "kvsched/Scheduling-v0", "algo": "es"}, "env_kwargs")])
def test_evaluate_names_the_metadata_file_and_the_missing_key(tmp_path, meta, key):
    from kvsched.agents.evaluate import evaluate

    ckpt = tmp_path / "a.zip"
    shutil.copyfile(ROOT / "agents" / "checkpoints" / "bench-v1" / "es-overload-burst-s0.zip", ckpt)
    (tmp_path / "a.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=rf"training metadata .*a\.json: missing key '{key}'"):
        evaluate([str(ckpt)], None, 1, 1, tmp_path / "o")
    (tmp_path / "a.json").write_text('{"env_id": ')
    with pytest.raises(ConfigError, match=r"a\.json: cannot be read: not JSON"):
        evaluate([str(ckpt)], None, 1, 1, tmp_path / "o")


def test_leaderboard_refuses_an_untrusted_checkpoint_before_any_episode(tmp_path, capsys, monkeypatch):
    import kvsched.experiments.suite.agents as suite_agents
    from kvsched.experiments.cli import main

    monkeypatch.setattr(suite_agents, "evaluate_agent", lambda *a, **k: pytest.fail("episodes ran"))
    marker = tmp_path / "pwned"
    ckpt = crafted_checkpoint(tmp_path, marker)
    (tmp_path / "crafted.json").write_text(json.dumps(
        {"env_id": "kvsched/Scheduling-v0", "algo": "maskable_ppo", "env_kwargs": {}}))
    code = main(["leaderboard", "--tasks", "overload-burst", "--agents", str(ckpt)])
    err = capsys.readouterr().err
    assert code == 2 and "is not one kvsched wrote" in err and not marker.exists()
