"""The ``dbsp`` command line (also ``python -m dbsp_core``).

- ``dbsp demo [options]``: the main job, a durable auction pipeline (``dbsp demo --help``);
- ``dbsp inspect DIR [--json] [--no-check]``: what a storage directory holds (scale, checkpoint, logs, output steps,
  sizes, state bytes per worker and shard, the batch files the checkpoint names with their sizes and the result of
  checking them, consumers, the metrics of the last checkpoint), without running its circuit;
- ``dbsp profile DIR [--json]``: where the time went in the run that last checkpointed the directory: per
  operator and per view, time per step, rows, state (dbsp_core.profile), from its ``PROFILE`` record;
- ``dbsp read DIR VIEW [--from-step N] [--limit K]``: the changes of one view from the output log;
- ``dbsp run FILE.sql --storage DIR``: a durable pipeline defined in SQL alone, its tables' and views' connectors
  started, until Ctrl-C; the next run resumes exactly once (dbsp_core.run);
- ``dbsp sql FILE.sql [--view NAME]``: compile CREATE TABLE / CREATE VIEW statements and print the plan of each
  view (operators, exchanges, state).
- ``inspect``, ``profile`` and ``read`` also take the URI of an object store a pipeline keeps its storage in
  (``s3://bucket/prefix?endpoint_override=...``; credentials from the environment): its newest checkpoint is
  restored into a temporary directory and read there (dbsp_core.runtime.remote_state).
- ``dbsp repair DIR [--drop-output FIRST..LAST] [--json]``: the way forward from damaged files: keeps a copy of
  what it replaces, reports exactly which pushes are lost, and leaves a directory that opens, or says what is
  damaged and what to do (exit status 1); ``--drop-output`` consents to dropping output history that cannot be
  computed again, as the refusal names it (dbsp_core.storage.repair).
  ``dbsp repair URI [--fall-back] [--json]`` of a store pipeline checks every stage object the newest manifest
  names; when one is missing or damaged it names the newest whole checkpoint the logs can be replayed from and,
  only with ``--fall-back``, makes it the newest; else it refuses and says what is lost (runtime/stage_check.py).
  ``dbsp inspect URI`` lists the stage chains per (stage, worker), the objects no manifest names and the damage.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Iterator

from dbsp_core.errors import DbspError


def _through(next_step: int) -> str:
    """A position as the steps it holds, by the output log's numbering: "through step 1" holds steps 0 and 1."""
    return f"through step {next_step - 1}" if next_step > 0 else "before step 0"


def _shown(where: str) -> str:
    """``where`` as messages name it: a URI without its secrets (dbsp_core.storage.location rule 2)."""
    from dbsp_core.storage.location import mask_uri

    return mask_uri(where) if "://" in where else where


@contextlib.contextmanager
def _local(where: str) -> Iterator[tuple[str, dict | None]]:
    """A storage directory to read: ``where`` itself, or an object store's newest checkpoint restored into a
    temporary directory (with its manifest)."""
    from dbsp_core.storage.remote import is_remote

    if not is_remote(where):
        yield where, None
        return
    from dbsp_core.runtime.remote_state import restored

    with restored(where) as (root, manifest, _):
        yield root, manifest


def _inspect(args: argparse.Namespace) -> int:
    from dbsp_core.storage.inspect import inspect_storage

    with _local(args.dir) as (root, manifest):
        info = inspect_storage(root, check_files=not args.no_check)
    if manifest is not None:
        info["path"] = _shown(args.dir)
        info["store"] = {"manifest": manifest["version"], "step": manifest["step"],
                         "databases": {k: len(v["chain"]) for k, v in manifest["databases"].items()},
                         "files": len(manifest["files"]), "logs": manifest["logs"].get("mode", "segments")}
        info["stage_chains"] = _stage_chains(args.dir, not args.no_check)
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
        return 0
    b = info["bytes"]
    ck = info["checkpoint_step"]
    out = info["output_steps"]
    print(f"storage      {info['path']} ({info['executor']} executor, directory format {info.get('format')})")
    st = info.get("store")
    if st:
        print(f"store        manifest {st['manifest']} (checkpoint {_through(st['step'])}): "
              f"{', '.join(f'{k} {n} objects' for k, n in sorted(st['databases'].items()))}; {st['files']} batch "
              f"files; logs: {st['logs']}")
    sc = info.get("stage_chains")
    if sc:
        _print_stage_chains(sc, info["path"])
    per = info["shards_per_worker"]
    print(f"layout       {info['workers']} workers, {info['shards']} shards (epoch {info['layout_epoch']}; "
          f"{min(per)}..{max(per)} shards per worker); circuit {info['fingerprint']}")
    last = info["last_rescale"]
    if info["rescale_in_progress"]:
        print("rescale      a layout change was interrupted; the next open finishes or undoes it")
    if last:
        moved = last.get("moved_bytes")
        frac = f" ({moved / last['total_bytes']:.1%} of state)" if moved is not None and last.get("total_bytes") \
            else ""
        print(f"last change  {last.get('kind', '?')} rescale {last.get('from_workers')} -> {last.get('to_workers')} "
              f"workers at step {last.get('step')}: {last.get('moved_shards')} shards, "
              f"{moved if moved is not None else '?':,} B moved{frac} in {last.get('seconds', 0):.3f} s")
    print(f"inputs       {', '.join(info['inputs'])}")
    print(f"outputs      {', '.join(info['outputs'])}")
    if info["in_use"]:
        print(f"checkpoint   not read: {', '.join(info['in_use'])} in use by a running pipeline")
    else:
        none = "none whole" if info.get("state_missing") else "none consistent"
        print(f"checkpoint   {none if ck is None else _through(ck)} "
              f"(versions per worker: {', '.join(f'{a}..{z}' for a, z in info['versions'])})")
    for f in info.get("state_missing", []):
        print(f"state        {f} MISSING: LAYOUT names it (dbsp repair {info['path']} says what to do)")
    for f in info.get("state_unnamed", []):
        print(f"state        {f} not named by LAYOUT: " + ("a database of the layout change in progress"
                                                           if info["rescale_in_progress"] else
                                                           "never read (dbsp repair moves it aside)"))
    div = info["divided_steps"]
    print(f"input log    {info['input_records']} records in {info['input_segments']} segments, steps "
          f"{info['input_steps'][0]}..{info['input_steps'][1]}"
          + (f", divided steps {div[0]}..{div[1]}" if div else ", no divided step"))
    held = f"steps {out[0]}..{out[1] - 1}" if out[1] > out[0] else "no step"
    refs = info.get("output_by_reference")
    print(f"output log   {held} ({out[1] - out[0]} steps) in {info['output_segments']} segments"
          + (f"; {refs} of them name their view's rows in the input log (kept as long as they)" if refs else ""))
    change = info.get("program_change")
    if change:
        print(f"program      changed at step {change['step']}: rebuilt {', '.join(change['rebuilt']) or 'no view'} "
              f"(their output starts there with their contents), removed {', '.join(change['removed']) or 'none'}")
    print(f"disk         input {b['input']:,} B, output {b['output']:,} B, state {b['state']:,} B")
    for w, shards in sorted(info["state_bytes"].items(), key=lambda kv: int(kv[0])):
        top = sorted(shards.items(), key=lambda kv: -kv[1])[:3]
        print(f"state w{w:<9} {sum(shards.values()):,} B in {len(shards)} shards"
              + (f" (largest: {', '.join(f'shard {s} {n:,} B' for s, n in top)})" if top else ""))
    bf = info.get("batch_files")
    if bf is not None and (bf["files"] or bf["unnamed"]):
        bad = len(bf["bad"])
        print(f"batch files  {len(bf['files'])} named by the checkpoint, {bf['bytes']:,} B"
              + (f"; {bad} NOT INTACT (dbsp repair {info['path']})" if bad else
                 ", every one checked" if not args.no_check else ", not checked (--no-check)")
              + (f"; {len(bf['unnamed'])} named by none (the next open removes them)" if bf["unnamed"] else ""))
        for f in bf["files"]:
            size = "missing" if f["bytes"] is None else f"{f['bytes']:,} B"
            rows = f", {f['rows']:,} rows" if f["rows"] is not None else ""
            print(f"             {f['file']}  {size}{rows}  {', '.join(sorted(f['tables']))}  {f['check']}")
    cons = info["consumers"]
    print(f"consumers    {', '.join(f'{n} {_through(s)}' for n, s in cons.items()) if cons else 'none registered'}")
    m = info["metrics"]
    if m:
        lat = m["step_seconds"]
        ms = (lambda x: "-" if x is None else f"{x * 1000:.1f} ms")
        print(f"counters     {_through(m['steps'])}, {m['pushes']} pushes; rows in "
              f"{', '.join(f'{k} {v:,}' for k, v in m['rows_in'].items())}; rows out "
              f"{', '.join(f'{k} {v:,}' for k, v in m['rows_out'].items())}")
        print(f"             step latency mean {ms(lat['mean'])}, p50 {ms(lat.get('p50'))}, p99 {ms(lat.get('p99'))}; "
              f"{m['checkpoints']} checkpoints, last {m['checkpoint_seconds']:.3f} s (as of the last checkpoint)")
        auto = m.get("autoscale")
        if auto:
            pol, last = auto["policy"], auto.get("last") or {}
            counts = ", ".join(f"{k} {v}" for k, v in sorted(auto["decisions"].items()))
            print(f"autoscale    {pol['min_workers']}..{auto['cap']} workers; {auto['rescales']} rescales "
                  f"({auto['failed_rescales']} failed); decisions {counts}")
            for c in auto.get("changes", [])[-5:]:
                print(f"             {c['reason']} {c['workers']} -> {c['target']} ({c['result']}): {c['why']}")
            if last:
                print(f"             last: {last['action']} {last['workers']} -> {last['target']} ({last['reason']}): "
                      f"{last['why']}")
    return 0


def _stage_chains(where: str, check: bool) -> dict | None:
    """The stage chains of a store pipeline (dbsp_core.runtime.stage_check), None without any."""
    import tempfile

    from dbsp_core.runtime.stage_check import inspect_stage_chains
    from dbsp_core.storage.remote import Remote

    return inspect_stage_chains(Remote.of(where, tempfile.gettempdir()), check)


def _print_stage_chains(sc: dict, shown: str) -> None:
    bad = len(sc["damaged"])
    print(f"stage chains {len(sc['chains'])} (stage, worker) chains in manifest {sc['manifest']} "
          f"({_through(sc['step'])}); "
          + (f"{bad} links DAMAGED (dbsp repair {shown})" if bad else
             "every link checked" if sc["checked"] else "links listed, not checked (--no-check)"))
    for key, ch in sc["chains"].items():
        stage, worker = key.split("/")
        vs = ch["versions"]
        print(f"  stage {stage} worker {worker}: {ch['links']} links, {ch['bytes']:,} B"
              + (f", versions {vs[0]}..{vs[1]}" if vs else ""))
        for link in ch["objects"]:
            span = f"{link['from']}->{link['to']}" if link["kind"] == "delta" else f"base at {link['to']}"
            print(f"             {link['object']}  {link['bytes']:,} B  {span}  manifests "
                  f"{', '.join(map(str, link['manifests']))}  {link['check']}")
    un = sc["unnamed"]
    if un:
        print(f"  named by no manifest: {len(un)} objects, {sum(u['bytes'] for u in un):,} B (retention deletes them; "
              f"the newest may be jobs' work since the last checkpoint)")
        for u in un:
            print(f"             {u['object']}  {u['bytes']:,} B")


def _read(args: argparse.Namespace) -> int:
    with _local(args.dir) as (root, _):
        return _read_dir(args, root)


def _read_dir(args: argparse.Namespace, root: str) -> int:
    from dbsp_core.storage.inspect import open_output

    log = open_output(root)
    try:
        if args.view not in log.schemas:
            print(f"error: no view {args.view!r}; views are {sorted(log.schemas)}", file=sys.stderr)
            return 2
        shown = 0
        for step, z in log.read(args.view, args.from_step):
            print(f"step {step}: {len(z)} changed rows")
            for row in z.to_arrow().slice(0, args.limit).to_pylist():
                print(f"  {row}")
            shown += 1
        if not shown:
            print(f"no output steps from step {args.from_step}")
    finally:
        log.close()
    return 0


def _sql(args: argparse.Namespace) -> int:
    from dbsp_core.sql import SqlError, compile
    from dbsp_core.sql.explain import explain

    with open(args.file, encoding="utf-8") as f:
        text = f.read()
    try:
        c = compile(text)
    except SqlError as e:
        print(f"{args.file}:{e.line}:{e.column}: {str(e).split(': ', 1)[-1]}", file=sys.stderr)
        return 2
    try:
        print(explain(c, args.view or None))
    except KeyError as e:
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 2
    return 0


def _steps(text: str) -> tuple[int, int]:
    """``FIRST..LAST`` (or one step) as a pair of ints."""
    first, _, last = text.partition("..")
    try:
        a, b = int(first), int(last or first)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected FIRST..LAST (steps, e.g. 0..4), got {text!r}") from None
    if not 0 <= a <= b:
        raise argparse.ArgumentTypeError(f"expected 0 <= FIRST <= LAST, got {text!r}")
    return a, b


def _repair_store(args: argparse.Namespace) -> int:
    """``dbsp repair URI [--fall-back]``: a store pipeline's stage chains (dbsp_core.runtime.stage_check)."""
    from dbsp_core.runtime.stage_check import repair_stage_chains

    if args.drop_output is not None:
        print("error: --drop-output repairs a local storage directory's output log; a store pipeline's logs are "
              "segment objects", file=sys.stderr)
        return 2
    report = repair_stage_chains(args.dir, fall_back=args.fall_back)
    ok = not report["damaged"] or report["done"]
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return 0 if ok else 1
    print(f"repair       {report['path']} (newest manifest {report['manifest']}, {_through(report['step'])})")
    for d in report["damaged"]:
        print(f"damaged      {d['object']}: {d['problem']}")
    fb = report["fallback"]
    if fb:
        print(f"whole        manifest {fb['manifest']} ({_through(fb['step'])}): recovery replays the input log from "
              f"step {fb['replays_from_step']}")
    for d in report["lost"]:
        print(f"lost         {d['object']}" + (f" (stage/worker {d['chain']})" if d["chain"] else ""))
    print(f"result       {report['result']}")
    if report["action"]:
        print(f"what to do   {report['action']}")
    return 0 if ok else 1


def _repair(args: argparse.Namespace) -> int:
    from dbsp_core.storage.remote import is_remote
    from dbsp_core.storage.repair import repair

    if is_remote(args.dir):
        return _repair_store(args)
    if args.fall_back:
        print("error: --fall-back is for a pipeline in an object store (dbsp repair s3://...)", file=sys.stderr)
        return 2
    try:
        report = repair(args.dir, drop_output=args.drop_output)
    except DbspError as exc:  # nothing was changed; the message says why and what to do
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return 1 if report["unrepaired"] else 0
    print(f"repair       {report['path']}")
    for d in report["input_damaged"]:
        print(f"damaged      input/{d['segment']} bytes {d['from']}..{d['to']}")
    for n in report["input_missing"]:
        print(f"missing      input/{n} (every record it held is lost)")
    for lost in report["lost"]:
        print(f"lost         producer {lost['producer']!r} seq {lost['seq']}"
              + (f" (step {lost['step']})" if lost["step"] >= 0 else ""))
    if report["lost_unnamed"]:
        print(f"lost         {report['lost_unnamed']} more pushes that no record names (anonymous ones)")
    if report["output_dropped"]:
        a, b = report["output_dropped"]
        print(f"dropped      the output of steps {a}..{b}")
    for what in report["repaired"]:
        print(f"repaired     {what}")
    for u in report["unrepaired"]:
        print(f"NOT REPAIRED {u['file']}: {u['problem']}\n             what to do: {u['action']}")
    print(f"result       {report['result']}")
    return 1 if report["unrepaired"] else 0


def _profile(args: argparse.Namespace) -> int:
    import os

    from dbsp_core.profile import PROFILE_FORMAT, format_table
    from dbsp_core.storage.directory import read_meta, read_record
    from dbsp_core.storage.formats import PROFILE_FILE, PROFILE_MAGIC

    with _local(args.dir) as (root, _):
        read_meta(root)  # FileNotFoundError when it is no storage directory
        prof = read_record(os.path.join(root, PROFILE_FILE), PROFILE_MAGIC)
    if prof is None:
        print(f"error: {_shown(args.dir)} holds no profile: it is written at each checkpoint; run the pipeline until it "
              "checkpoints (or close it), then ask again", file=sys.stderr)
        return 1
    if prof.get("format") != PROFILE_FORMAT:
        print(f"error: {_shown(args.dir)}: PROFILE is of format {prof.get('format')!r}; this dbsp_core reads format "
              f"{PROFILE_FORMAT}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(prof, indent=2, sort_keys=True))
        return 0
    print(f"profile of {_shown(args.dir)} {_through(prof['step'])} ({prof['executor']} executor, "
          f"{prof['workers']} workers; operator times since it was last opened; state in memory only for the "
          f"embedded executor)")
    print(format_table(prof), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    args_list = sys.argv[1:] if argv is None else list(argv)
    if args_list[:1] == ["demo"]:  # the demo parses its own options (dbsp demo --help)
        from dbsp_core.demo import run_demo

        return run_demo(args_list[1:])
    parser = argparse.ArgumentParser(prog="dbsp", description="dbsp_core command line")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="run the main job: the durable auction pipeline demo (dbsp demo --help)")
    ins = sub.add_parser("inspect", help="summarize a storage directory")
    ins.add_argument("dir")
    ins.add_argument("--json", action="store_true", help="print the summary as JSON")
    ins.add_argument("--no-check", action="store_true",
                     help="list the batch files the checkpoint names without checking every byte of them")
    pf = sub.add_parser("profile", help="print where the time went at a storage directory's last checkpoint")
    pf.add_argument("dir")
    pf.add_argument("--json", action="store_true", help="print the profile as JSON")
    rd = sub.add_parser("read", help="print the changes of one view from a storage directory's output log")
    rd.add_argument("dir")
    rd.add_argument("view")
    rd.add_argument("--from-step", type=int, default=0)
    rd.add_argument("--limit", type=int, default=10, help="rows shown per step (default 10)")
    from dbsp_core.run import add_arguments

    add_arguments(sub.add_parser("run", help="run a pipeline defined in SQL (connectors in WITH) until Ctrl-C"))
    sq = sub.add_parser("sql", help="compile a SQL file and print the plan of each view")
    sq.add_argument("file")
    sq.add_argument("--view", action="append", help="only this view (repeatable)")
    rp = sub.add_parser("repair", help="repair a damaged storage directory, or say what is damaged and what to do")
    rp.add_argument("dir")
    rp.add_argument("--drop-output", type=_steps, metavar="FIRST..LAST", default=None,
                    help="drop the output of these steps, which is damaged and cannot be computed again (state and "
                         "input are kept); the refusal names the exact steps")
    rp.add_argument("--fall-back", action="store_true",
                    help="an object store's pipeline whose newest checkpoint has a missing or damaged stage object: "
                         "make the newest whole checkpoint the newest again (the logs are replayed from it)")
    rp.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(args_list)
    if args.command == "run":
        from dbsp_core.run import run

        return run(args)
    if args.command == "sql":
        try:
            return _sql(args)
        except OSError as exc:
            print(f"error: cannot read {args.file}: {exc}", file=sys.stderr)
            return 2
    try:
        return {"inspect": _inspect, "profile": _profile, "read": _read, "repair": _repair}[args.command](args)
    except (FileNotFoundError, NotADirectoryError) as exc:
        print(f"error: {_shown(args.dir)} is not a dbsp storage directory ({exc})", file=sys.stderr)
        return 2
    except DbspError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
