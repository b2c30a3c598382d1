"""flashqla-tune keygen --out KEY: a new Ed25519 key pair for signing kernel packs."""
from __future__ import annotations


def add_parser(sub):
    p = sub.add_parser("keygen", help="make an Ed25519 key pair to sign kernel packs with")
    p.add_argument("--out", required=True, metavar="KEY",
                   help="private key file to write (mode 0600; never overwritten); the public key goes to KEY.pub")
    return p


def run(args) -> int:
    from ..pack_signing import generate_key, public_key_id

    private, public = generate_key(args.out)
    print(f"private key {private} (keep it to yourself; sign with: flashqla-tune build --sign {private})")
    print(f"public key  {public} (key id {public_key_id(public)}; load with: flashqla_tune.load(PACK, "
          f"trusted_keys=[{str(public)!r}]))")
    return 0
