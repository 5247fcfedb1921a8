"""``lmcache kvcache {clear,objects}``: manage what a running ``lmcache server`` holds.

``clear --url URL`` empties L1 (``POST /cache/clear``, as LMCache 0.5.6 does; objects a
request is reading or writing stay unless ``--force``). ``objects --url URL`` lists the
objects an L2 adapter holds (``GET /cache/objects``), one page, or every page with
``--all``. ``--format/--output/-q`` go before or after the action.
"""

from __future__ import annotations

import argparse
import urllib.parse

from lmcache.cli.errors import CLIError
from lmcache.cli.report import Report, add_output_args

_OBJECT_COLUMNS = (
    ("chunk_hash_hex", "Chunk hash"),
    ("model_name", "Model"),
    ("kv_rank", "KV rank"),
    ("object_group_id", "Group"),
    ("cache_salt", "Salt"),
    ("size_bytes", "Bytes"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_output_args(parser)
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    clear = actions.add_parser("clear", help="clear all cached KV data in L1 (CPU)")
    clear.add_argument(
        "--url", required=True, help="the server's HTTP API (e.g. http://localhost:8080)"
    )
    clear.add_argument(
        "--force",
        action="store_true",
        help="also drop objects that requests are reading or writing (ours)",
    )
    add_output_args(clear, inherit=True)
    clear.set_defaults(func=_clear)
    objects = actions.add_parser("objects", help="list the objects an L2 adapter holds (ours)")
    objects.add_argument(
        "--url", default="http://localhost:8080", help="the server's HTTP API (default %(default)s)"
    )
    objects.add_argument("--adapter", default=None, help="which L2 adapter (default: the first)")
    objects.add_argument("--model-name", default=None, help="only this model's objects")
    objects.add_argument(
        "--page-size", type=int, default=500, help="objects per page (1-5000, default 500)"
    )
    objects.add_argument("--page-token", default=None, help="continue from this page token")
    objects.add_argument("--all", action="store_true", help="follow every page to the end")
    add_output_args(objects, inherit=True)
    objects.set_defaults(func=_objects)

    def no_action(_args: argparse.Namespace) -> int:
        raise CLIError("name an action: lmcache kvcache {clear,objects} --url URL")

    parser.set_defaults(func=no_action)


def _clear(args: argparse.Namespace) -> int:
    from lmcache.cli.http_client import base_url, call

    body = {"tier": "l1", "force": True} if args.force else {"tier": "l1"}
    call("POST", f"{base_url(args.url)}/cache/clear", body)
    report = Report("KV Cache Clear")
    report.add("status", "Status", "OK")
    report.emit(args)
    return 0


def _objects(args: argparse.Namespace) -> int:
    from lmcache.cli.http_client import base_url, call

    if not 1 <= args.page_size <= 5000:
        raise CLIError(f"--page-size must be 1..5000 (got {args.page_size})")
    query = {"tier": "l2", "page_size": args.page_size}
    for name, value in (("adapter", args.adapter), ("model_name", args.model_name)):
        if value is not None:
            query[name] = value
    token, rows, page = args.page_token, [], {}
    while True:
        if token:
            query["page_token"] = token
        page = call("GET", f"{base_url(args.url)}/cache/objects?{urllib.parse.urlencode(query)}")
        for entry in page.get("entries") or []:
            row = dict(entry.get("key") or {})
            row["size_bytes"] = entry.get("size_bytes")
            rows.append(row)
        token = page.get("next_page_token")
        if not (args.all and token):
            break
    report = Report("KV Cache Objects", width=56)
    report.add("adapter", "Adapter", page.get("adapter"))
    report.add("shared", "Shared", page.get("shared"))
    report.add("count", "Objects", len(rows))
    report.add("next_page_token", "Next page token", token)
    table = report.table("objects", *_OBJECT_COLUMNS)
    for row in rows:
        table.add_row(**{k: row.get(k) for k, _h in _OBJECT_COLUMNS})
    report.emit(args)
    return 0
