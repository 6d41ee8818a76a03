"""The `pergrad` command: `serve` runs a server (needs pergrad[server]); `info` and
`grads` are the client's (numpy and gRPC only).

This package sits beside the client and the server: the client never imports the server,
and `pergrad serve` reaches the server from here, only when asked for.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        return _serve(argv[1:])
    from pergrad.cli.commands import run

    return run(argv)


def _serve(argv: Sequence[str]) -> int:
    try:
        from pergrad.server.serve import serve
    except ImportError as err:
        print(
            f"pergrad serve needs the server: pip install 'pergrad[server]' ({err})",
            file=sys.stderr,
        )
        return 2
    return serve(argv)
