"""Where an archive comes from: its signature, or its pinned digest.

artifact.json lists the size and sha256 of every other member, so `verify` proves an archive is consistent, not who
made it: anyone can write a new archive with a changed model.py and matching hashes. Origin is proven one of two
ways, each checked in the same read of the archive as everything else:

- a signature: `trtpipe package --key PRIVATE.pem` (an Ed25519 key the user holds: `openssl genpkey -algorithm
  ed25519 -out signing.pem`) writes `artifact.sig` right after artifact.json: the Ed25519 signature of
  artifact.json's exact bytes, which cover every member through their hashes. `verify` / `unpack --public-key
  PUBLIC.pem` (`openssl pkey -in signing.pem -pubout -out signing.pub`) refuse an archive without it or whose
  signature does not verify with that key;
- a pinned digest: `package` prints the archive's sha256; `verify` / `unpack --sha256 HEX` refuse any other
  archive (what `trtpipe k8s --repo-source artifact:URL#sha256=HEX` pins in the pod).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import UserError

SIGNATURE = "artifact.sig"
ALGORITHM = "ed25519"
SHA256_HEX = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Origin:
    """What `verify` is asked to prove of the archive's origin (neither: consistency only)."""

    public_key: object | None = None      # cryptography Ed25519PublicKey
    sha256: str | None = None

    @property
    def asked(self) -> bool:
        return self.public_key is not None or self.sha256 is not None


def origin_from_options(public_key: Path | None, sha256: str | None) -> Origin:
    """The command line's --public-key FILE and --sha256 HEX, checked (UserError, exit 2)."""
    digest = sha256.lower().removeprefix("sha256:") if sha256 is not None else None
    if digest is not None and not SHA256_HEX.fullmatch(digest):
        raise UserError(f"--sha256 must be the archive's 64 hex digits (as `trtpipe package` prints), got {sha256!r}")
    return Origin(load_public_key(public_key) if public_key else None, digest)


def load_private_key(path: Path):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    key = load_pem(Path(path), lambda data: load_pem_private_key(data, password=None), "private")
    if not isinstance(key, Ed25519PrivateKey):
        raise UserError(f"{path} is not an Ed25519 private key (make one with `openssl genpkey -algorithm ed25519 "
                        f"-out {Path(path).name}`)")
    return key


def load_public_key(path: Path):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    key = load_pem(Path(path), load_pem_public_key, "public")
    if not isinstance(key, Ed25519PublicKey):
        raise UserError(f"{path} is not an Ed25519 public key (`openssl pkey -in PRIVATE.pem -pubout`)")
    return key


def load_pem(path: Path, load, kind: str):
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read the {kind} key {path}: {exc.strerror or exc}") from None
    try:
        return load(data)
    except (ValueError, TypeError) as exc:
        raise UserError(f"{path} is not a PEM {kind} key ({exc})") from None


def key_id(public_key) -> str:
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    raw = public_key.public_bytes(Encoding.Raw, PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def signature_member(manifest: bytes, private_key) -> bytes:
    """artifact.sig: the Ed25519 signature of artifact.json's bytes, with the key's id."""
    signature = private_key.sign(manifest)
    return (json.dumps({"algorithm": ALGORITHM, "key_id": key_id(private_key.public_key()),
                        "signature": base64.b64encode(signature).decode()}, indent=2) + "\n").encode()


def signature_problem(manifest: bytes, member: bytes | None, public_key) -> str | None:
    """Why the archive is not signed by `public_key` (None: it is)."""
    from cryptography.exceptions import InvalidSignature

    if member is None:
        return f"not signed: the archive has no {SIGNATURE} (package it with --key)"
    try:
        record = json.loads(member)
        signature = base64.b64decode(record["signature"], validate=True)
    except (ValueError, KeyError, TypeError):
        return f"{SIGNATURE} is not a signature record"
    if record.get("algorithm") != ALGORITHM:
        return f"{SIGNATURE}: algorithm {record.get('algorithm')!r}, not {ALGORITHM}"
    try:
        public_key.verify(signature, manifest)
    except InvalidSignature:
        return (f"{SIGNATURE} does not verify with the key given (key {key_id(public_key)}; the archive says "
                f"{record.get('key_id')}): artifact.json was changed or signed by another key")
    return None
