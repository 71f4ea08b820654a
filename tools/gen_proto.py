"""Regenerate jaxserve/proto/*_pb2*.py from jaxserve/proto/*.proto with grpcio-tools.

.venv/bin/python tools/gen_proto.py
"""

import os
import sys

from grpc_tools import protoc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if __name__ == "__main__":
    os.chdir(ROOT)
    status = protoc.main(
        [
            "grpc_tools.protoc",
            "-I.",
            "--python_out=.",
            "--pyi_out=.",
            "--grpc_python_out=.",
            "jaxserve/proto/jaxserve.proto",
            "jaxserve/proto/disagg.proto",
        ]
    )
    sys.exit(status)
