"""Which checkpoints kvsched loads without asking: the ones it wrote, or shipped.

Loading a Stable-Baselines3 / sb3-contrib checkpoint (``.zip``) or an RLlib checkpoint folder
unpickles its contents (Python's ``pickle``: the file names functions to call while it is
read), so a crafted checkpoint runs any code it likes on the machine that loads it. kvsched
therefore loads a checkpoint only when it can tell that kvsched wrote it:

- every checkpoint kvsched writes (``kvsched train``: ``final.zip``, ``checkpoints/*.zip``,
  ``eval/best_model.zip``, RLlib's ``checkpoint/``; the evolution strategy's; behaviour clones)
  gets a sidecar ``<checkpoint>.sha256`` with the SHA-256 of its content and an HMAC-SHA256 of
  that digest under a secret key of this user (``~/.config/kvsched/checkpoint.key``, made on
  first use, mode 0600; the environment variable ``KVSCHED_CHECKPOINT_KEY`` names another key
  file). A sidecar cannot be forged without the key, so a checkpoint that arrives with a
  sidecar someone else made is still refused;
- the checkpoints shipped in the package (``agents/checkpoints``, the suite's clones in
  ``experiments/suite/results``) are trusted by content: their SHA-256 are listed in
  :mod:`kvsched.agents.shipped_checkpoints` inside the package;
- anything else (a downloaded file, a checkpoint changed after it was written, one written by
  kvsched under another user or machine) is refused with a one-line error unless the caller
  passes ``trust=True`` (``--trust-checkpoint`` on the command line): do that only for files
  whose origin you trust as you would trust a Python script from it.

Checkpoints of the evolution strategy (NumPy ``.npz`` read with ``allow_pickle=False``) hold no
pickle, but they are checked the same way: which loader runs is chosen by the metadata beside
the checkpoint, which the same person could have written.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path

from kvsched import atomic_files
from kvsched.envs.sim.errors import MAX_PATH_CHARS, ConfigError, bounded_repr

SUFFIX = ".sha256"
KEY_ENV = "KVSCHED_CHECKPOINT_KEY"
TRUST_FLAG = "--trust-checkpoint"
_CHUNK = 1 << 20


#: Largest sidecar read (a record is about 200 bytes).
MAX_SIDECAR_BYTES = 64 * 1024


def _file_sha256(path: Path) -> str:
    if not path.is_file():  # a FIFO or device would block open() or never end
        raise ConfigError(f"checkpoint file {bounded_repr(str(path), MAX_PATH_CHARS)} is not a regular file")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def digest(path: str | os.PathLike[str]) -> str:
    """SHA-256 (hex) of a checkpoint file, or of a checkpoint folder: of the lines
    ``<relative path>\\0<file SHA-256>\\n`` of its files in sorted order (symbolic links refused).

    Raises:
        OSError: unreadable. ConfigError: a folder holding a symbolic link; the file (or a file in
        the folder) is not a regular file (a FIFO, a device: reading it would block).
    """
    p = Path(path)
    if p.exists() and not p.is_dir() and not p.is_file():
        raise ConfigError(f"checkpoint {bounded_repr(str(p), MAX_PATH_CHARS)} is not a regular file or a folder")
    if not p.is_dir():
        return _file_sha256(p)
    h = hashlib.sha256()
    for f in sorted(x for x in p.rglob("*") if not x.is_dir() or x.is_symlink()):
        if f.is_symlink():
            raise ConfigError(f"checkpoint {bounded_repr(str(p))}: holds a symbolic link {bounded_repr(str(f))}")
        h.update(f.relative_to(p).as_posix().encode("utf-8", "surrogateescape") + b"\0"
                 + _file_sha256(f).encode() + b"\n")
    return h.hexdigest()


def key_path() -> Path:
    """The key file: ``$KVSCHED_CHECKPOINT_KEY``, else ``$XDG_CONFIG_HOME/kvsched/checkpoint.key``
    (``~/.config`` when unset)."""
    given = os.environ.get(KEY_ENV)
    if given:
        return Path(given)
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "kvsched" / "checkpoint.key"


def _key(create: bool) -> bytes | None:
    p = key_path()
    try:
        return bytes.fromhex(p.read_text().strip())
    except FileNotFoundError:
        if not create:
            return None
    except ValueError:
        raise ConfigError(f"checkpoint key {bounded_repr(str(p))} is not a hex key; remove it (kvsched makes a new "
                          "one; checkpoints signed with the old one then need --trust-checkpoint)") from None
    p.parent.mkdir(parents=True, exist_ok=True)
    try:  # exclusive: of two processes making it at once, one wins and both read its key
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return bytes.fromhex(p.read_text().strip())
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return bytes.fromhex(p.read_text().strip())


def _tag(key: bytes, sha: str) -> str:
    return hmac.new(key, sha.encode(), hashlib.sha256).hexdigest()


def sidecar(path: str | os.PathLike[str]) -> Path:
    """``<checkpoint>.sha256`` (for a folder: beside it, ``<folder>.sha256``)."""
    p = Path(path)
    return p.with_name(p.name + SUFFIX)


def record(path: str | os.PathLike[str]) -> Path:
    """Write the sidecar of the checkpoint ``path`` kvsched just wrote (module doc); returns it."""
    sha = digest(path)
    key = _key(create=True)
    assert key is not None
    side = sidecar(path)
    atomic_files.write_text(side, json.dumps({"sha256": sha, "hmac_sha256": _tag(key, sha),
                                              "file": Path(path).name}) + "\n")
    return side


def shipped_digests() -> dict[str, str]:
    """The shipped checkpoints' SHA-256 (relative path -> hex)."""
    from .shipped_checkpoints import SHIPPED_SHA256

    return dict(SHIPPED_SHA256)


def check(path: str | os.PathLike[str], trust: bool = False, flag: str = TRUST_FLAG) -> None:
    """Refuse to load the checkpoint ``path`` unless kvsched wrote or shipped it (module doc).

    Args:
        trust: load it anyway (``--trust-checkpoint``).
        flag: the flag that says so, named in the message.

    Raises:
        ConfigError: one line naming the checkpoint, why it is not trusted and ``flag``.
    """
    if trust:
        return
    p = Path(path)
    shown = bounded_repr(str(p))
    why_pickle = (f"loading a checkpoint unpickles it, which can run any code; pass {flag} only if you trust where "
                  "it came from")
    try:
        sha = digest(p)
    except OSError as e:
        raise ConfigError(f"checkpoint {shown}: cannot be read ({e.strerror or e})") from None
    if sha in shipped_digests().values():
        return
    side = sidecar(p)
    if side.exists() and not side.is_file():
        raise ConfigError(f"checkpoint {shown}: its {side.name} is not a regular file; {why_pickle}")
    if not side.is_file():
        raise ConfigError(f"checkpoint {shown} is not one kvsched wrote: no {side.name} beside it; {why_pickle}")
    try:
        if side.stat().st_size > MAX_SIDECAR_BYTES:
            raise ValueError("too large for a record")
        rec = json.loads(side.read_text())
        recorded, tag = str(rec["sha256"]), str(rec["hmac_sha256"])
    except (OSError, ValueError, KeyError, TypeError, RecursionError):  # RecursionError: '[' * 10**5
        raise ConfigError(f"checkpoint {shown}: its {side.name} is not a kvsched checkpoint record; "
                          f"{why_pickle}") from None
    if recorded != sha:
        raise ConfigError(f"checkpoint {shown} changed after kvsched wrote it (its SHA-256 differs from the one in "
                          f"{side.name}); {why_pickle}")
    key = _key(create=False)
    if key is None or not hmac.compare_digest(_tag(key, sha), tag):
        raise ConfigError(f"checkpoint {shown}: its {side.name} was not written by kvsched under this user's key "
                          f"({bounded_repr(str(key_path()))}; e.g. it was trained on another machine); {why_pickle}")
