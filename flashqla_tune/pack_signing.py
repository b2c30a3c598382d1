"""Ed25519 signatures of kernel packs: who built a pack, checked before any of its code is opened.

A pack's manifest records its files' sha256, but in the same folder: whoever can replace a binary
can rewrite the manifest too, so the hashes show damage, never authorship. A signature made with a
private key its owner keeps elsewhere does: PACK/signature.json holds an Ed25519 signature over a
canonical list of sha256 digests (`signed_files`: manifest.json byte for byte, every kernel
binary the manifest lists, the prebuilt host extension and calibration.json), and the public key
that made it. `flashqla_tune.load(PACK, trusted_keys=[...])` recomputes the list from the files on
disk and accepts the pack only when one of the trusted keys signed exactly that list.

Keys: `generate_key(path)` writes a private key (PEM, PKCS #8, mode 0600) and its public key beside
it as <path>.pub (PEM). `load_public_key` reads a trusted key given as an Ed25519PublicKey, raw 32
bytes, PEM bytes or text, or a path to a PEM or raw file. The `cryptography` package is imported
only where a key is used.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from .files import atomic_write_text, sha256_file
from .pack import CALIBRATION, MANIFEST, Manifest, PackError, check_binaries, check_calibration, read_manifest

SIGNATURE = "signature.json"
SIGNATURE_SCHEMA = "flashqla-tune.pack-signature"
SIGNATURE_VERSION = 1
ALGORITHM = "ed25519"
_MESSAGE_HEADER = b"flashqla-tune pack signature 1\n"


class PackSignatureError(PackError):
    """A pack is unsigned, signed by no trusted key, or its files differ from what was signed."""


class SigningKeyError(ValueError):
    """A key file or key value cannot be used (wrong type, wrong format, would overwrite a file)."""


@dataclass(frozen=True)
class SignedPack:
    """A signature that checked out: the key that made it and the digests it covers."""
    key_id: str
    files: dict


def key_id(public_raw: bytes) -> str:
    """A short name of a public key: the first 16 hex digits of the sha256 of its raw 32 bytes."""
    return hashlib.sha256(public_raw).hexdigest()[:16]


def generate_key(path) -> tuple[Path, Path]:
    """Write a new Ed25519 private key to `path` (mode 0600, never over an existing file) and its
    public key to <path>.pub; returns both paths."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    path = Path(path)
    public_path = path.with_name(path.name + ".pub")
    for target in (path, public_path):
        if target.exists() or target.is_symlink():
            raise SigningKeyError(f"{target} exists; not overwriting a key (remove it first or choose another --out)")
    if not path.parent.is_dir():
        raise SigningKeyError(f"{path.parent} is not a folder")
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
    public_pem = key.public_key().public_bytes(serialization.Encoding.PEM,
                                               serialization.PublicFormat.SubjectPublicKeyInfo)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private_pem)
    os.chmod(path, 0o600)  # whatever the umask
    fd = os.open(public_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(public_pem)
    return path, public_path


def load_private_key(path):
    """The Ed25519 private key of a PEM file written by generate_key."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SigningKeyError(f"cannot read private key {path}: {exc}") from exc
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise SigningKeyError(f"{path} is not an unencrypted PEM private key ({exc})") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise SigningKeyError(f"{path} holds a {type(key).__name__}, not an Ed25519 private key")
    return key


def load_public_key(value):
    """A trusted key as an Ed25519PublicKey: given as one, as raw 32 bytes, as PEM bytes or text,
    or as a path (str or Path) to a PEM or raw-bytes file."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    if isinstance(value, Ed25519PublicKey):
        return value
    where = "the key value"
    if isinstance(value, str) and not value.lstrip().startswith("-----BEGIN"):
        value = Path(value)
    if isinstance(value, os.PathLike):
        where = str(value)
        try:
            value = Path(value).read_bytes()
        except OSError as exc:
            raise SigningKeyError(f"cannot read trusted key {where}: {exc}") from exc
    if isinstance(value, str):
        value = value.encode()
    if not isinstance(value, (bytes, bytearray)):
        raise SigningKeyError(f"a trusted key must be an Ed25519 public key, its bytes (raw or PEM) or a path, "
                        f"got {type(value).__name__}")
    value = bytes(value)
    if len(value) == 32:
        return Ed25519PublicKey.from_public_bytes(value)
    if b"PRIVATE KEY" in value:
        raise SigningKeyError(f"{where} is a private key; give load() the public key (the .pub file keygen wrote)")
    try:
        key = serialization.load_pem_public_key(value)
    except (ValueError, TypeError) as exc:
        raise SigningKeyError(f"{where} is neither a PEM public key nor 32 raw Ed25519 key bytes ({exc})") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise SigningKeyError(f"{where} holds a {type(key).__name__}, not an Ed25519 public key")
    return key


def _raw(public_key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def public_key_id(public_key) -> str:
    """The key id of a public key in any form load_public_key takes."""
    return key_id(_raw(load_public_key(public_key)))


def signed_files(manifest: Manifest) -> list[str]:
    """The files a signature covers, as paths relative to the pack, sorted: the manifest, every
    kernel binary it lists (the backward's libraries too), its host extension and the calibration."""
    names = {MANIFEST, CALIBRATION, *(p.so for p in manifest.plans)}
    if manifest.host_extension is not None:
        names.add(manifest.host_extension.so)
    names.update(b.so for b in manifest.backward)
    return sorted(names)


def digests(pack, manifest: Manifest, manifest_bytes: bytes | None = None) -> dict:
    """sha256 of each signed file as it is on disk now (a missing file is a PackSignatureError);
    manifest_bytes, when given, are the manifest as the caller read and parsed it."""
    pack = Path(pack)
    out = {}
    for name in signed_files(manifest):
        path = pack / name
        if name == MANIFEST and manifest_bytes is not None:
            out[name] = hashlib.sha256(manifest_bytes).hexdigest()
            continue
        if not path.is_file():
            raise PackSignatureError(f"pack {pack} lacks {name}, which its signature must cover")
        out[name] = sha256_file(path)
    return out


def message(files: dict) -> bytes:
    """The bytes an Ed25519 signature is made over: a header line, then `<sha256>  <path>` per file
    in sorted path order (paths never hold a newline: the manifest's names are checked)."""
    lines = [f"{files[name]}  {name}\n" for name in sorted(files)]
    return _MESSAGE_HEADER + "".join(lines).encode()


def sign_pack(pack, private_key_path) -> Path:
    """Sign a pack whose files match its manifest: write PACK/signature.json (atomically) and
    return its path."""
    pack = Path(pack)
    key = load_private_key(private_key_path)
    manifest = read_manifest(pack)
    check_binaries(pack, manifest)        # sign what the manifest describes, not a damaged folder
    check_calibration(pack, manifest)
    files = digests(pack, manifest)
    public_raw = _raw(key.public_key())
    record = {"schema": SIGNATURE_SCHEMA, "version": SIGNATURE_VERSION, "algorithm": ALGORITHM,
              "public_key": base64.b64encode(public_raw).decode(), "key_id": key_id(public_raw),
              "files": files, "signature": base64.b64encode(key.sign(message(files))).decode()}
    return atomic_write_text(pack / SIGNATURE, json.dumps(record, indent=1, sort_keys=True) + "\n")


def read_signature(pack) -> dict:
    pack = Path(pack)
    path = pack / SIGNATURE
    if not path.is_file():
        raise PackSignatureError(f"pack {pack} is not signed (no {SIGNATURE}); trusted keys were given, so it "
                                 f"is refused: sign it (flashqla-tune sign) or build it with --sign")
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise PackSignatureError(f"{path} is damaged (not JSON: {exc})") from exc
    if (not isinstance(record, dict) or record.get("schema") != SIGNATURE_SCHEMA
            or record.get("version") != SIGNATURE_VERSION or record.get("algorithm") != ALGORITHM
            or not isinstance(record.get("signature"), str) or not isinstance(record.get("files"), dict)):
        raise PackSignatureError(f"{path} is not a {SIGNATURE_SCHEMA} version {SIGNATURE_VERSION} "
                                 f"{ALGORITHM} signature")
    return record


def verify_pack(pack, trusted_keys, manifest: Manifest | None = None, manifest_bytes: bytes | None = None
                ) -> SignedPack:
    """Check that one of `trusted_keys` signed this pack's current files; raise PackSignatureError
    naming what differs otherwise. Reads files only: nothing of the pack is opened as code."""
    from cryptography.exceptions import InvalidSignature

    pack = Path(pack)
    if isinstance(trusted_keys, (str, bytes, os.PathLike)):
        trusted_keys = [trusted_keys]
    keys = [load_public_key(k) for k in trusted_keys]
    if not keys:
        raise SigningKeyError("trusted_keys is empty: give at least one public key, or None to skip the "
                              "signature check")
    manifest = manifest if manifest is not None else read_manifest(pack)
    record = read_signature(pack)
    files = digests(pack, manifest, manifest_bytes)
    signed = record["files"]
    changed = sorted(name for name in set(files) | set(signed) if files.get(name) != signed.get(name))
    if changed:
        details = "; ".join(f"{name}: signed {str(signed.get(name, 'nothing'))[:16]}, on disk "
                            f"{files.get(name, 'not covered')[:16]}" for name in changed)
        raise PackSignatureError(f"pack {pack}: files differ from what was signed ({details}); refused")
    try:
        signature = base64.b64decode(record["signature"], validate=True)
    except ValueError as exc:
        raise PackSignatureError(f"pack {pack}: {SIGNATURE} holds no valid base64 signature") from exc
    body = message(files)
    for key in keys:
        try:
            key.verify(signature, body)
        except InvalidSignature:
            continue
        return SignedPack(key_id(_raw(key)), files)
    trusted = ", ".join(key_id(_raw(k)) for k in keys)
    raise PackSignatureError(f"pack {pack} is signed by key {record.get('key_id')!r}, which is not among the trusted "
                             f"keys ({trusted}), or its signature does not match its files; refused")


__all__ = ["SigningKeyError", "PackSignatureError", "SIGNATURE", "SignedPack", "digests", "generate_key", "key_id",
           "load_private_key", "load_public_key", "message", "public_key_id", "read_signature", "sign_pack", "signed_files",
           "verify_pack"]
