"""Generate the Python gRPC code of proto/ into rebalancer/v1/.

The generated modules are committed, so an installed package needs no
grpcio-tools. CI runs this with --check, which fails when the committed code
differs from what the .proto files generate (a stale API).

    python scripts/gen_proto.py          # regenerate
    python scripts/gen_proto.py --check  # exit 1 if stale
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
OUT_PACKAGE = ROOT / "rebalancer" / "v1"
GENERATED = ("rebalancer_pb2.py", "rebalancer_pb2.pyi", "rebalancer_pb2_grpc.py")


def generate(out_root: Path) -> None:
    from grpc_tools import protoc  # dev dependency only

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed code is stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = Path(tmp) / "rebalancer" / "v1"
        if args.check:
            stale = [
                name
                for name in GENERATED
                if not (OUT_PACKAGE / name).exists()
                or not filecmp.cmp(fresh / name, OUT_PACKAGE / name, shallow=False)
            ]
            if stale:
                print(f"generated gRPC code is stale: {', '.join(stale)}; run scripts/gen_proto.py")
                return 1
            print("generated gRPC code is up to date")
            return 0
        OUT_PACKAGE.mkdir(parents=True, exist_ok=True)
        for name in GENERATED:
            shutil.copyfile(fresh / name, OUT_PACKAGE / name)
        init = OUT_PACKAGE / "__init__.py"
        if not init.exists():
            init.write_text('"""Generated gRPC code of proto/rebalancer/v1 (do not edit)."""\n')
    print(f"wrote {', '.join(GENERATED)} to {OUT_PACKAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
