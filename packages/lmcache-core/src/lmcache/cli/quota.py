"""``lmcache quota {set,get,delete,list}``: per-``cache_salt`` L1 quotas of a running server.

Talks to the server's ``/quota`` routes (default ``--url http://localhost:8080``) with
LMCache 0.5.6's arguments and reports. The salt ``_default`` (or ``""``) names un-salted
traffic.
"""

from __future__ import annotations

import argparse
import urllib.parse
from typing import Any

from lmcache.cli.report import Report, add_output_args

DEFAULT_URL = "http://localhost:8080"
DEFAULT_SALT = "_default"  # the server's name for the empty cache_salt in a URL


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="quota_target", metavar="ACTION", required=True)
    salt_help = "the cache_salt; '_default' for un-salted traffic"
    for name, help_text, func in (
        ("set", "create or update the quota of a cache_salt", _set),
        ("get", "show the quota and current usage of a cache_salt", _get),
        ("delete", "remove the quota of a cache_salt", _delete),
        ("list", "list every quota and its usage", _list),
    ):
        p = actions.add_parser(name, help=help_text)
        if name != "list":
            p.add_argument("salt", help=salt_help)
        if name == "set":
            p.add_argument(
                "--limit-gb",
                type=float,
                required=True,
                metavar="GB",
                help="quota limit in gigabytes (>= 0)",
            )
        p.add_argument(
            "--url", default=DEFAULT_URL, help=f"server HTTP API (default {DEFAULT_URL})"
        )
        add_output_args(p)
        p.set_defaults(func=func)


def _salt_url(args: argparse.Namespace) -> tuple[str, str]:
    from lmcache.cli.http_client import base_url

    salt = args.salt if args.salt != "" else DEFAULT_SALT
    return salt, f"{base_url(args.url)}/quota/{urllib.parse.quote(salt, safe='')}"


def _set(args: argparse.Namespace) -> int:
    return _call_and_report(
        args,
        "PUT",
        "Quota Set",
        (("limit_gb", "Limit (GB)", args.limit_gb), ("status", "Status", "ok")),
        {"limit_gb": args.limit_gb},
    )


def _get(args: argparse.Namespace) -> int:
    return _call_and_report(
        args,
        "GET",
        "Quota Info",
        (
            ("limit_gb", "Limit (GB)", None),
            ("current_usage_gb", "Current usage (GB)", None),
            ("exists", "Exists", None),
        ),
    )


def _delete(args: argparse.Namespace) -> int:
    return _call_and_report(args, "DELETE", "Quota Delete", (("status", "Status", "unknown"),))


def _call_and_report(
    args: argparse.Namespace,
    method: str,
    title: str,
    fields: tuple[tuple[str, str, Any], ...],
    body: Any = None,
) -> int:
    """One request on the salt's quota; the reply's cache_salt and ``fields`` (key, label,
    value when the reply lacks it) as a report."""
    from lmcache.cli.http_client import call

    salt, url = _salt_url(args)
    result = call(method, url, body) or {}
    report = Report(title)
    report.add("cache_salt", "Cache salt", result.get("cache_salt", salt))
    for key, label, default in fields:
        report.add(key, label, result.get(key, default))
    report.emit(args)
    return 0


def _list(args: argparse.Namespace) -> int:
    from lmcache.cli.http_client import base_url, call

    users = (call("GET", f"{base_url(args.url)}/quota") or {}).get("users") or {}
    report = Report("Quota List", width=55)
    if not users:
        report.add("info", "Info", "No quotas configured")
    for idx, (salt, info) in enumerate(users.items()):
        sec = report.section(f"quota_{idx}", f"Salt: {salt}", group="quotas")
        sec.add("cache_salt", "Cache salt", salt)
        sec.add("limit_gb", "Limit (GB)", info.get("limit_gb"))
        sec.add("current_usage_gb", "Current usage (GB)", info.get("current_usage_gb"))
    report.emit(args)
    return 0
