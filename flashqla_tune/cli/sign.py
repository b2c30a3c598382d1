"""flashqla-tune sign PACK --key KEY: sign an existing kernel pack (PACK/signature.json)."""
from __future__ import annotations


def add_parser(sub):
    p = sub.add_parser("sign", help="sign a kernel pack with an Ed25519 private key (flashqla-tune keygen)")
    p.add_argument("pack", help="pack folder")
    p.add_argument("--key", required=True, metavar="KEY", help="private key file written by flashqla-tune keygen")
    return p


def run(args) -> int:
    from ..pack_signing import sign_pack

    path = sign_pack(args.pack, args.key)
    print(f"{args.pack}: signed ({path}); load it with flashqla_tune.load(PACK, trusted_keys=[<the .pub file>])")
    return 0
