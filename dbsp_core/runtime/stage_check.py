"""Checking a store pipeline's stage chains (runtime/stage_store.py) without running its circuit: what ``dbsp inspect`` lists per (stage, worker), the check ``Pipeline.open`` makes before it claims the store, and what ``dbsp repair`` can do when a chain link is missing or damaged.

Rules (enforced here):
  1. Reading only, but for :func:`repair_stage_chains` with ``fall_back``: inspect and the open check write nothing
     to the store. A full check downloads each stage object the manifests name once (into a temporary directory,
     removed after) and checks it as a task would read it: a delta's frame (magic, format version, CRC), a base's
     page file (``Database.check`` of the version the chain says).
  2. ``Pipeline.open`` checks, with one LIST, that every link of the restored manifest's chains is present at the
     size its chain records, before the writer's claim manifest is written: a missing or cut link raises
     CorruptionError naming the object, the (stage, worker), the manifest and ``dbsp repair``; nothing is written
     but the writer's lease. Damage that keeps the size is found by the checksum where a task first reads the
     object (CorruptionError the same way, e.g. in the replay of ``open``), or by ``dbsp inspect``.
  3. Repair never changes an object. When the newest manifest's chains are not whole, it looks for the newest
     older manifest whose chains are whole (every link fully checked) and whose other objects (``db/``,
     ``spill/``) are present; recovery from it replays the logs from its step (retention keeps the log segments
     of both live manifests, storage/remote_log.py invariant 3), so nothing acknowledged is lost. Only with
     ``fall_back`` does it take a writer lease (fencing a writer still running, storage.remote invariant 6) and
     commit a copy of that manifest as the newest, two versions above every listed one (as a claim does); without
     it, or when no manifest is whole, it changes nothing and says what is lost and what to do.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from dbsp_core.codec import check_framed_file
from dbsp_core.errors import CorruptionError, DbspError, FormatVersionError, RecoveryError
from dbsp_core.runtime.stage_store import STAGE_DIR, object_version
from dbsp_core.storage.database import Database
from dbsp_core.storage.formats import REMOTE_DELTA_MAGIC, REMOTE_SPILL_DIR, REMOTE_STATE_DIR
from dbsp_core.storage.remote import Remote

__all__ = ["check_present", "inspect_stage_chains", "repair_stage_chains"]


def _links(manifest: dict) -> list[tuple[str, dict]]:
    """Every (``stage/worker`` key, link) of the chains ``manifest`` names (none for a pipeline without stages)."""
    chains = (manifest.get("stages") or {}).get("chains", {})
    return [(key, link) for key, chain in sorted(chains.items()) for link in chain]


def _where(remote: Remote, key: str, link: dict) -> str:
    stage, worker = key.split("/")
    span = f"{link['from']}->{link['to']}" if link["kind"] == "delta" else f"at {link['to']}"
    return f"{remote.shown}/{link['object']} (stage {stage} worker {worker}, {link['kind']} {span})"


def _presence(link: dict, listed: dict[str, int]) -> str | None:
    """What is wrong with ``link`` by the listing alone (rule 2), None if nothing."""
    size = listed.get(link["object"])
    if size is None:
        return "missing"
    if size != link["bytes"]:
        return f"{size} bytes, its chain records {link['bytes']}"
    return None


def check_present(remote: Remote, manifest: dict) -> None:
    """Rule 2: every link of ``manifest``'s chains is in the store at its size, else CorruptionError."""
    links = _links(manifest)
    if not links:
        return
    listed = remote.list(STAGE_DIR)
    for key, link in links:
        problem = _presence(link, listed)
        if problem is not None:
            raise CorruptionError(
                f"{_where(remote, key, link)}: {problem}; manifest {manifest['version']} (step {manifest['step']}) "
                f"needs it to rebuild that state, so the pipeline cannot open from it. Run `dbsp repair "
                f"{remote.shown}`: it says whether an older checkpoint is whole and the logs can be replayed from it")


def _check_content(remote: Remote, key: str, link: dict, scratch: str) -> str | None:
    """Rule 1: the object read as a task reads it; None if intact, else what is wrong."""
    path = os.path.join(scratch, "object")
    try:
        remote.get_file(link["object"], path, sync=False)
        if link["kind"] == "delta":
            with open(path, "rb") as f:
                check_framed_file(REMOTE_DELTA_MAGIC, f, _where(remote, key, link))
        else:
            with Database(path, readonly=True) as db:
                db.check(link["to"])
        return None
    except FileNotFoundError:
        return "missing"
    except (CorruptionError, FormatVersionError) as e:
        return DbspError.__str__(e).split(": ", 1)[-1]  # without the repair hint: the report says what to do
    except KeyError:
        return f"the page file holds no version {link['to']}"
    finally:
        for p in (path, path + ".tmp"):
            if os.path.exists(p):
                os.remove(p)


class _Checker:
    """The problems of stage links, each object checked once (by listing, then by content unless ``quick``)."""

    def __init__(self, remote: Remote, quick: bool) -> None:
        self.remote, self.quick = remote, quick
        self.listed = remote.list(STAGE_DIR)
        self.seen: dict[str, str | None] = {}
        self.scratch = tempfile.mkdtemp(prefix="dbsp-check-")

    def problem(self, key: str, link: dict) -> str | None:
        name = link["object"]
        if name not in self.seen:
            got = _presence(link, self.listed)
            if got is None and not self.quick:
                got = _check_content(self.remote, key, link, self.scratch)
            self.seen[name] = got
        return self.seen[name]

    def close(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)


def _manifests(remote: Remote) -> list[dict]:
    """Every manifest that reads back whole, newest first."""
    out = []
    for v in reversed(remote.manifest_versions()):
        try:
            out.append(remote.read_manifest(v))
        except (CorruptionError, FormatVersionError, FileNotFoundError):
            continue
    return out


def inspect_stage_chains(remote: Remote, check: bool = True) -> dict | None:
    """What ``dbsp inspect`` shows of the stage state in the store: None for a pipeline with no stage chains.

    ``chains``: per ``stage/worker``, the newest manifest's chain (links, bytes, versions) and every link any
    manifest names with the manifests naming it and its check (``"ok"``, ``"present"`` without ``check``, or the
    problem); ``unnamed``: objects under ``stage/`` no manifest names (garbage retention deletes, or the work of
    jobs since the newest checkpoint); ``damaged``: the links with a problem.
    """
    ms = _manifests(remote)
    if not any(m.get("stages") for m in ms):
        return None
    checker = _Checker(remote, quick=not check)
    try:
        per: dict[str, dict[str, dict]] = {}
        for m in ms:
            for key, link in _links(m):
                ent = per.setdefault(key, {}).setdefault(link["object"], dict(link, manifests=[]))
                ent["manifests"].append(m["version"])
        newest = ms[0]
        out_chains: dict[str, Any] = {}
        damaged = []
        for key in sorted(per, key=lambda k: tuple(int(x) for x in k.split("/"))):
            links = sorted(per[key].values(), key=lambda link: (link["to"], link["kind"] != "base"))
            for link in links:
                problem = checker.problem(key, link)
                link["check"] = problem or ("ok" if check else "present")
                if problem:
                    damaged.append({"chain": key, "object": link["object"], "problem": problem,
                                    "manifests": link["manifests"]})
            chain = (newest.get("stages") or {}).get("chains", {}).get(key, [])
            out_chains[key] = {"links": len(chain), "bytes": sum(link["bytes"] for link in chain),
                               "versions": [chain[0].get("from", chain[0]["to"]), chain[-1]["to"]] if chain else None,
                               "objects": links}
        named = {name for links in per.values() for name in links}
        unnamed = [{"object": n, "bytes": b, "version": object_version(n)}
                   for n, b in sorted(checker.listed.items()) if n not in named]
        return {"manifest": newest["version"], "step": newest["step"], "checked": check, "chains": out_chains,
                "unnamed": unnamed, "damaged": damaged}
    finally:
        checker.close()


def _whole(remote: Remote, m: dict, checker: _Checker) -> list[dict]:
    """The problems of manifest ``m``: its stage links (rule 1), then its ``db/`` and ``spill/`` objects by listing."""
    bad = [{"object": link["object"], "chain": key, "problem": p}
           for key, link in _links(m) if (p := checker.problem(key, link)) is not None]
    others = {**remote.list(REMOTE_STATE_DIR), **remote.list(REMOTE_SPILL_DIR)}
    names = [link["object"] for d in m.get("databases", {}).values() for link in d["chain"]]
    names += [f["object"] for f in m.get("files", {}).values()]
    bad += [{"object": n, "chain": None, "problem": "missing"} for n in names if n not in others]
    return bad


def repair_stage_chains(storage: Any, fall_back: bool = False) -> dict:
    """``dbsp repair URI`` for a store pipeline's stage chains (rule 3). Returns the report: ``damaged`` (the newest
    manifest's problems), ``fallback`` (the manifest recovery can restart from, its step, and the steps the logs
    replay) or None, ``done`` (whether a fallback manifest was committed), ``lost`` (what no manifest holds whole,
    when there is no fallback), ``result`` and ``action`` (what to do next)."""
    tmp = tempfile.mkdtemp(prefix="dbsp-repair-")
    try:
        remote = Remote.of(storage, tmp)
        ms = _manifests(remote)
        if not ms:
            raise RecoveryError(f"{remote.shown} holds no pipeline (no manifest that reads back whole)")
        checker = _Checker(remote, quick=False)
        try:
            newest = ms[0]
            report: dict[str, Any] = {"path": remote.shown, "manifest": newest["version"], "step": newest["step"],
                                      "damaged": _whole(remote, newest, checker), "fallback": None, "done": False,
                                      "lost": [], "action": ""}
            if not report["damaged"]:
                report["result"] = "nothing to repair: every object the newest manifest names is whole"
                return report
            for m in ms[1:]:
                if m["step"] <= newest["step"] and not _whole(remote, m, checker):
                    report["fallback"] = {"manifest": m["version"], "step": m["step"],
                                          "replays_from_step": m["step"]}
                    break
        finally:
            checker.close()
        fb = report["fallback"]
        if fb is None:
            report["lost"] = report["damaged"]
            report["result"] = ("refused: no manifest in the store has whole chains, so the state they hold is lost; "
                                "nothing was changed")
            report["action"] = ("put the objects listed back from a copy of the store (the same names and bytes: e.g. "
                                "bucket versioning or a backup), then run `dbsp repair` again; or start the pipeline "
                                "anew from its sources")
            return report
        if not fall_back:
            report["result"] = (f"not repaired: manifest {fb['manifest']} (step {fb['step']}) is whole; recovery from "
                                f"it replays steps {fb['step']} on from the input log (nothing acknowledged is lost); "
                                f"nothing was changed")
            report["action"] = f"run `dbsp repair {remote.shown} --fall-back` to make it the newest checkpoint"
            return report
        lease = remote.take_lease()  # fences a writer still running on the damaged history (rule 3)
        v = max(remote.manifest_versions()) + 2
        body = {k: x for k, x in next(m for m in ms if m["version"] == fb["manifest"]).items()
                if k not in ("format", "written_ns")}
        body.update(version=v, writer=lease["generation"], repaired={"from": fb["manifest"], "damaged": newest["version"]})
        remote.check_lease(lease, f"commit the fallback manifest {v}")
        remote.write_manifest(body)
        report.update(done=True, result=f"fell back: manifest {v} is manifest {fb['manifest']}'s checkpoint (step "
                                        f"{fb['step']}); the next open replays the input log from step {fb['step']}",
                      action=f"open the pipeline: Pipeline.open({remote.shown!r}, circuit)")
        return report
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
