"""`moemesh placement apply FILE --url URL`: have a running router switch to a placement file.

Posts the file to the router's `POST /v1/admin/placement`, which loads new experts on their
workers, switches every attention worker between two steps, then drops what workers no longer
own (services.router.placement_admin). Prints the router's report (JSON). The API key comes from
--api-key or $MOEMESH_API_KEY. Pure Python: httpx only, imported when run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def add_apply_arguments(sub) -> None:
    apply = sub.add_parser("apply", help="switch a running deployment to a placement file (load, switch, drop)")
    apply.add_argument("file", help="placement TOML")
    apply.add_argument("--url", default="http://127.0.0.1:8000", help="the router's base URL")
    apply.add_argument("--endpoint", action="append", default=[], metavar="NAME=ENDPOINT",
                       help="endpoint of an expert worker the router's deployment does not list (repeat)")
    apply.add_argument("--api-key", default=None, help="bearer key (default: $MOEMESH_API_KEY)")
    apply.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the whole sequence")


def run_apply(args: argparse.Namespace) -> int:
    import httpx

    from moemesh.common.placement.placement_file import parse_toml

    text = Path(args.file).read_text()
    parse_toml(text, args.file)  # refuse a malformed file here, before the router sees it
    endpoints = {}
    for item in args.endpoint:
        name, sep, endpoint = item.partition("=")
        if not sep or not name or not endpoint:
            raise ValueError(f"--endpoint {item!r}: expected NAME=ENDPOINT")
        endpoints[name] = endpoint
    key = args.api_key or os.environ.get("MOEMESH_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        response = httpx.post(args.url.rstrip("/") + "/v1/admin/placement", headers=headers, timeout=args.timeout,
                              json={"placement_toml": text, "endpoints": endpoints})
    except httpx.HTTPError as error:
        print(f"moemesh placement apply: error: {error}", file=sys.stderr)
        return 1
    try:
        body = response.json()
    except ValueError:
        body = {"error": {"message": response.text[:500]}}
    if response.status_code != 200:
        print(f"moemesh placement apply: error {response.status_code}: {body.get('error', {}).get('message', body)}",
              file=sys.stderr)
        return 1
    print(json.dumps(body, indent=2))
    return 0
