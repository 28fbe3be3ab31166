"""`kiln perf run | plot | compare | serve-sweep | startup`."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

DEFAULT_OUT = Path("perf/results")


def cmd_run(args: argparse.Namespace) -> int:
    _quiet_http_log()
    from kiln.config_file import ConfigError, load_serve_config
    from kiln.perf.run import write
    from kiln.perf.spec import load_spec

    try:
        spec = load_spec(args.spec)
        if args.offline:
            from kiln.perf.offline import run_offline

            if spec.extra_body or spec.mode != "completions":
                raise ConfigError(f"{args.spec}: extra_body and mode {spec.mode} are HTTP's; drop --offline")

            overrides = {"model": {"model": args.model}} if args.model else {}
            config = load_serve_config(args.config, overrides)
            result = run_offline(config, spec, args.label or "offline")
        else:
            if not (args.base_url and args.model):
                args.parser.error("--base-url and --model are needed (or --offline)")
            from kiln.perf.client import Endpoint
            from kiln.perf.run import run_http

            ep = Endpoint(args.base_url.rstrip("/").removesuffix("/v1"), args.model, args.api_key)
            result = run_http(ep, spec, args.label or "server")
    except ConfigError as e:
        args.parser.error(str(e))
    json_path, csv_path = write(result, args.out)
    sys.stdout.write(f"{json_path}\n{csv_path}\n")
    return 0 if all(p.summary.failed == 0 for p in result.points) else 1


def cmd_plot(args: argparse.Namespace) -> int:
    from kiln.perf.plot import plot
    from kiln.perf.run import read

    for path in plot([read(p) for p in args.results], args.out):
        sys.stdout.write(f"{path}\n")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from kiln.perf.report import compare
    from kiln.perf.run import read

    sys.stdout.write(compare(read(args.a), read(args.b)) + "\n")
    return 0


def cmd_serve_sweep(args: argparse.Namespace) -> int:
    _quiet_http_log()
    from kiln.config_file import ConfigError
    from kiln.perf.spec import load_spec
    from kiln.perf.sweep import load_servers, serve_sweep

    try:
        servers, spec = load_servers(args.servers), load_spec(args.spec)
    except ConfigError as e:
        args.parser.error(str(e))
    results = serve_sweep(servers, spec, args.out)
    if args.plot:
        from kiln.perf.plot import plot

        plot(results, args.out)
    return 0 if all(p.summary.failed == 0 for r in results for p in r.points) else 1


def cmd_startup(args: argparse.Namespace) -> int:
    _quiet_http_log()
    from kiln.config_file import ConfigError
    from kiln.perf.startup import startup, table
    from kiln.perf.sweep import load_servers

    try:
        servers = load_servers(args.servers)
    except ConfigError as e:
        args.parser.error(str(e))
    rows = startup(servers, args.repeats, args.out)
    sys.stdout.write(table(rows) + f"\n{args.out / 'startup.json'}\n")
    return 0


def _quiet_http_log() -> None:
    # httpx logs every request at INFO, which would bury the sweep's own lines.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def add_perf_parser(commands: argparse._SubParsersAction) -> None:
    perf = commands.add_parser("perf", help="load sweeps, comparisons and plots")
    sub = perf.add_subparsers(dest="perf_command", required=True, metavar="PERF_COMMAND")

    run = sub.add_parser("run", help="sweep a spec against an OpenAI-compatible endpoint (or offline)")
    run.add_argument("--spec", type=Path, required=True, help="configs/perf/NAME.yaml")
    run.add_argument("--base-url", help="e.g. http://127.0.0.1:8000")
    run.add_argument("--model", help="the model name the server expects (offline: a model folder)")
    run.add_argument("--api-key")
    run.add_argument("--offline", action="store_true", help="drive kiln's engine in-process, without HTTP")
    run.add_argument("--config", type=Path, help="offline: a kiln serve config for the engine")
    run.add_argument("--label", help="name of this result (default: server, or offline)")
    run.add_argument("--out", type=Path, default=DEFAULT_OUT)
    run.set_defaults(run=cmd_run, parser=run)

    plot = sub.add_parser("plot", help="PNG charts of results")
    plot.add_argument("results", type=Path, nargs="+", metavar="RESULT.json")
    plot.add_argument("--out", type=Path, default=DEFAULT_OUT)
    plot.set_defaults(run=cmd_plot, parser=plot)

    cmp = sub.add_parser("compare", help="every metric of two results and their ratio (B / A)")
    cmp.add_argument("a", type=Path, metavar="A.json")
    cmp.add_argument("b", type=Path, metavar="B.json")
    cmp.set_defaults(run=cmd_compare, parser=cmp)

    ss = sub.add_parser("serve-sweep", help="start each server in turn and run the spec against it")
    ss.add_argument("--servers", type=Path, required=True, help="YAML list of servers (configs/perf/)")
    ss.add_argument("--spec", type=Path, required=True)
    ss.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ss.add_argument("--plot", action="store_true", help="also write the charts")
    ss.set_defaults(run=cmd_serve_sweep, parser=ss)

    st = sub.add_parser("startup", help="time to ready, cold (caches emptied) and warm, median of N starts")
    st.add_argument("--servers", type=Path, required=True, help="YAML list of servers, with cache_dirs")
    st.add_argument("--repeats", type=int, default=3)
    st.add_argument("--out", type=Path, default=DEFAULT_OUT / "startup")
    st.set_defaults(run=cmd_startup, parser=st)
