"""Every on-disk format of a storage directory in one place: file names, magics, versions and byte layouts.

Directory format 2 (``DIRECTORY_FORMAT``), or 3 (``PRUNED_FORMAT``) for a directory whose join and window state keeps
only the columns read after it (META's ``stored_columns`` not empty, dbsp_core/runtime/prune.py): the same files,
the number telling a reader of format 2 alone (the release before column pruning) to refuse it, since it would read
those traces with their inputs' full schemas. Format 4 (``RANGE_FORMAT``): a directory whose state databases may
hold range values (``DRBR``, snapshot.py invariant 11: the embedded executor's checkpoints), which a reader of
formats 2 and 3 alone (the release before them) would take for damage; a superset of both: pruned or not is told
by META's ``stored_columns`` alone, as in format 3. The embedded executor writes it when it creates a directory and
raises a format-2 or -3 directory to it when it opens one (one META rewrite, before its first checkpoint can write a
range value: a crash after it leaves a format-4 directory without range values, which this release opens, and no
range value is ever under a META of format 2 or 3); the staged executor (and Spark) never writes range values and
keeps format 2 or 3. All three are read (``DIRECTORY_FORMATS``)::

    <root>/
      META                      the pipeline: circuit fingerprint (and one per input, output and node), executor,
                                inputs, outputs, output schemas, the last program change
      LAYOUT                    the layout in force (shards, owner table, epoch) and the last rescale's report
      RESCALE                   only while a layout change is in progress: from, to, base version, step
      REPAIR                    only while ``dbsp repair`` (or an output rebuild) swaps in repaired logs
      repair-<n>/               what a repair replaced: the old input/ or output/, damaged segments as they were,
                                the state databases before a damaged version was given up (state-worker-<w>.db),
                                state files set aside (a database LAYOUT does not name, or every one when the
                                state is computed again from the input log: storage/statefiles.py),
                                a damaged driver.db, LAYOUT or JOB (dbsp_core.storage.repair)
      LOCK                      flock(2)ed by the process that owns the directory (empty)
      driver.db                 Database: the dedup set and the clock at the driver's last checkpoint
      input/                    StepLog: pushes and one division record per step
      output/                   OutputLog: each step's output change and the input ranges that produced it
      state/worker-<w>.db       embedded executor: worker w's operator state
      state/stage-<k>/worker-<w>.db   staged executor: the state of stage k on worker w
      state/stage-<k>/worker-<w>.result   staged: the blobs of the committed attempt of the last job
      state/stage-<k>/worker-<w>.db.lock  staged: flock(2)ed by a stage task attempt
      state/JOB                 staged: the job running or last run (base version and steps)
      state/jobs/worker-<w>.input   staged: a job's stage-0 input while it runs (spark_glue)
      consumers/<name>          one consumer of the output log: the first step it still needs (storage.consumers)
      consumers/LOCK            flock(2)ed while a consumer registers or the output log is truncated (empty)
      METRICS                   the pipeline's metrics at its last checkpoint (dbsp_core.metrics), for inspect and
                                for the counters to go on from at the next open
      PROFILE                   the pipeline's profile at its last checkpoint (dbsp_core.profile), for dbsp profile
      spill/<tok>-<n>.batch     batch files of traces spilled under a memory budget (dbsp_core/trace/spill.py);
                                named by checkpoints (``DRBF`` values) instead of copying their rows; deleted when
                                no live batch reads them and no checkpoint that may be opened names them
      spill/merge-<random>.tmp  not a format: the raw output buffers of a merge built on disk (spill.py invariant
                                12), unlinked as soon as they are mapped, or (a VFS that adopts files: posix, the
                                fault one) kept, with room for a batch file's header before the rows, until the
                                merge ends and the file becomes its batch file in place (renamed: batchfile.py
                                invariant 7) or the merge is dropped (unlinked); one a crash left is deleted by
                                the next open's sweep. Its
                                rows reach disk as a batch file (above) when the merge ends

A pipeline whose ``storage=`` is an object store (dbsp_core.storage.remote) runs on a local cache directory of
the layout above (``cache_dir``, wiped and rebuilt from the store on open; ``.dbsp-cache`` marks it) and keeps
under its prefix in the store::

    <prefix>/
      manifest/<20-digit version>          DRMF: one per committed checkpoint, written last (the commit point)
      db/<db>/<20-digit version>.delta  DRDL: a database's values put and keys deleted since the last checkpoint
      db/<db>/<20-digit version>.base   a database's page file as it was at a checkpoint (a compacted chain)
      spill/<name>.batch                   a batch file a checkpoint names, as it is on local disk
      log/...                              the input and output logs (segment objects; see storage.remote)

Framed records (dbsp_core.codec): ``magic (4 bytes) | format version (u8) | checksum of the body (u32 LE) | body``;
version 2 (written since 2026-11-28) checksums with CRC-32C, version 1 with zlib's CRC-32, and both are read (the
body's layout is the same in both). The body of a JSON record is UTF-8 JSON with sorted keys.

==========  ======================================  =======================================================
magic       where                                   body
==========  ======================================  =======================================================
``DMET``    META                                    JSON: format, fingerprint, executor, inputs, outputs,
                                                    output_schemas (hex Arrow schemas), hash_version,
                                                    part_fingerprints: version (1), inputs and outputs
                                                    (name -> dbsp_core.circuit.part_fingerprints) and nodes
                                                    (by id; null for a node that never runs); absent
                                                    in directories made before it (refusals then name
                                                    only the circuit hashes; without nodes, a program
                                                    change is refused); after a program change
                                                    (dbsp_core.runtime.change): change (step, nodes: the
                                                    old circuit's node fingerprints, rebuilt, removed) and
                                                    since (view -> first step of its definition);
                                                    state_groups (the executor's state groups when the
                                                    directory was made: ``state`` or ``stage-<k>``; the
                                                    databases LAYOUT names, storage/statefiles.py; absent
                                                    in directories made before it); stored_columns (node
                                                    id -> the columns each of its traces' inputs keeps,
                                                    operators/pruned.py invariant 3: the schema of the
                                                    join and window state; absent or {} in directories
                                                    whose traces hold every column)
``DLAY``    LAYOUT                                  JSON: layout (dbsp_core.layout.Layout.to_dict),
                                                    last_rescale (report or null)
``DRSC``    RESCALE                                 JSON: kind (cold or live), from and to (layout records),
                                                    version, step, committed, report
``DRPR``    REPAIR                                  JSON: backup (the repair-<n> directory), parts (log
                                                    directories being replaced by their ``.new`` twins)
``DLWK``    key ``layout`` of table ``snapshot`` in  JSON: layout epoch, worker index, shard bits of the
            every state database (each version)     values stored in this version, and the layout itself
``DDIV``    input log record, handle "\\x00division"  JSON: step, pushes, now_ns, seed, watermarks
``DDSC``    input log record, handle "\\x00discard"   JSON: input, producer, seq (of the push dropped by
            (its producer and seq name the push)    ``Pipeline.discard``), step (the step it was in)
``DZS1``    input log push payloads; values of       Arrow IPC stream of the data columns plus int64
            ``z<node>.<attr>`` state tables; output  ``__dbsp_weight``; in an output log record, format
            log record parts                        version 3 (``OUTPUT_REF_VERSION``): JSON input, pushes
                                                    ([producer, seq] of the input log records of the same
                                                    step whose sum the output is; outputlog.py invariant 7)
``DFRF``    input log push payloads of a source     JSON: version (``FILE_REF_VERSION``, 1), path (absolute),
            that declares its files immutable       kind (parquet, csv, jsonl), unit (row group; 0 for text),
            (FileSource ``immutable_files=True``)   ino, size, mtime_ns (when pushed), crc32c (of the row
                                                    group's column chunks then the footer; of a text file
                                                    whole): the push's rows are read again from the file
                                                    (dbsp_core.storage.fileref)
``DRB1``    values of ``s<node>.<attr>`` tables      one schema-less Arrow IPC record batch (rows of one
                                                    shard of one trace batch, sorted by key hash)
``DRBG``    values of ``s<node>.<attr>`` tables      u32 run count, u32 run lengths, then one Arrow IPC
                                                    record batch: one shard's rows of several batches
``DRBR``    values of ``s<node>.<attr>`` tables      u32 width, u32 run count (width x batches), u32 run
            (written since 2026-11-30; a build     lengths, then one Arrow IPC record batch: the rows of
            before it refuses the value: bad       ``width`` consecutive shards of one trace batch or of a
            magic, a CorruptionError naming it)    group of batches, shard by shard, each shard's batches
                                                    in turn (snapshot.py invariant 11); never crosses a
                                                    multiple of ``RANGE_SHARDS`` shards; its key names its
                                                    first shard
``DRBF``    values of ``s<node>.<attr>`` tables      JSON: file (a batch file's name in spill/), lo, hi: the rows
                                                    of one shard of a spilled batch, read in place from the file
                                                    (snapshot.py invariant 8)
``DORD``    key ``order.<table>`` of ``snapshot``    JSON: numbers (batch numbers in trace order), counts
                                                    (batches per number, if any is not 1), settled
``DDUP``    table ``dedup`` of driver.db, key =      JSON: wm (every seq <= wm seen), above (seen seqs
            producer id (UTF-8)                     above wm)
``DCLK``    key ``now`` of table ``clock``,          JSON: now_ns (floor of the next step's now), prev_now_ns
            driver.db                               (now of the step before the checkpoint)
``DACK``    key ``since`` of table ``acked``,         JSON: step (driver.db's), pushes ([producer, seq] of every
            driver.db (written by a clean close)    named push the input log holds from that step on)
``DJOB``    state/JOB                               JSON: version (base), first, end (steps)
``DSTR``    state/stage-<k>/worker-<w>.result       job tag + an Arrow IPC blob table (dbsp_core.runtime.job_files)
``DJIN``    state/jobs/worker-<w>.input             job tag + an Arrow IPC blob table
``DSVL``    table ``stagelog`` of stage databases    JSON: trace keys added and deleted by the save of a version
``DCSM``    consumers/<name>                        JSON: name, next (every output step below it is durably
                                                    applied by the consumer; never decreases)
``DMTR``    METRICS                                 JSON: dbsp_core.metrics.Metrics.snapshot() at a checkpoint,
                                                    taken at its step, with step, duplicates and late_rows
``DPRF``    PROFILE                                 JSON: dbsp_core.profile.pipeline_profile() at a checkpoint
                                                    (format: PROFILE_FORMAT), and its step
``DRMF``    manifest/<version> in an object         JSON: format (REMOTE_MANIFEST_FORMAT), version, step,
            store                                   records (small record files inline, base64), databases
                                                    (path -> version, chain of objects), files (batch
                                                    files), logs (what the logs part records), written_ns;
                                                    stages (the stage chains, runtime/stage_store.py), writer,
                                                    repaired (from, damaged: dbsp repair --fall-back's copy)
``DRDL``    db/<db>/<version>.delta in an           body: records ``op (u8: 1 put, 0 delete, 2 step) |
            object store (also stage/<k>/<w>/...    table length (u16 LE) | table | key length (u16 LE)
            .delta, and a task cache's pending      | key | value length (u64 LE; not for a delete) |
            files state/stage-<k>/worker-<w>        value``, in commit order (database.Journal)
            .pending/<v>-<token>.delta,
            runtime/stage_store.py invariant 8)
``DLSG``    log segment objects in an object store  ``u32 n`` | ``n`` bytes of JSON: kind (input or output), first and
            (``<store>/log/<kind>/<first LSN>-<last  last (LSNs), gen (the writer's generation), steps ([lo, hi]),
            LSN>-g<gen>-s<lo step>-<hi step>.dlsg``) records | per record ``i64 step u64 seq u32 handle length u32
                                                    producer length u64 payload length`` (LE), handle, producer,
                                                    payload: step-log records (dbsp_core.storage.logstore)
``DOUT``    format-1 output segments                not framed as above: see the format-1 paragraph below
            (``output/out-<step>.seg``)
==========  ======================================  =======================================================

State values are keyed by :func:`dbsp_core.storage.database.shard_key` ``(shard, number)``: the shard as 4
big-endian bytes, then the value's number as 8 big-endian bytes (snapshot.py invariant 3); key ``next`` of
table ``snapshot`` holds the next unused number (8 big-endian bytes).

Batch files (``BATCH_FILE_MAGIC`` ``DBSPBTCH`` header, ``BATCH_FILE_FOOTER_MAGIC`` ``DBSPBTFT`` footer, format
``BATCH_FILE_VERSION`` 1), specified byte by byte in dbsp_core/trace/batchfile.py: one trace batch, immutable once
renamed into place: header (with the CRC-32C of the page-CRC section and of the fence and filter sections, so a
file can be opened reading metadata only and checked page by page as it is read), an embedded standard Arrow IPC
file (data columns, weight, key hash, row hash), the fence of its key hashes, a Bloom filter on them, a CRC-32C per
64 KiB page, and a footer with the whole file's CRC-32C. The same bytes can be uploaded as they are and named by a
checkpoint. It is streamed to ``<name>.tmp`` and renamed into place through the VFS (csrc/smallfile.c's writer), so
the fault-injecting VFS covers it like the page store and the step log. Format ``BATCH_FILE_GROUPED_VERSION`` 2
(the rows in groups of whole keys, one Arrow record batch a 4 KiB slot, a group index instead of the fence) is
written and read by dbsp_core/trace/groupedfile.py (specified there byte by byte); the spill store writes it for
its batches from ``DBSP_SPILL_GROUPED`` bytes on (off by default: dbsp_core/trace/spill.py invariant 18) and reads,
checkpoints and reopens either version whatever that says; the mapped reader (batchfile.open_batch) refuses it
naming groupedfile, and groupedfile.verify (so ``dbsp inspect`` and ``dbsp repair``) checks either version.

Formats below this module's level, specified byte by byte where they are written: the page file of a Database
(``DBSPMETA`` meta slots, csrc/pagestore.c), the step log (``DBSPSLOG`` header, ``DBSPSSEG`` segments
``<20-digit number>.seg`` and ``DSLR`` record frames, csrc/steplog.c; read in Python only by
dbsp_core.storage.salvage), the output log (dbsp_core/storage/outputlog.py, over step log segments).

Directory format 1 (dbsp-core 0.1.0, before the layout became data) kept ``workers`` and ``shard_bits`` in
META, worker databases at ``worker-<w>.db`` in the root and stage databases under ``stages/stage-<k>/`` (with
``stages/JOB``), a Z-set attribute as one value under key ``all``, and the embedded driver's dedup set and clock
in worker 0's database;
``Pipeline.open`` converts such a directory to format 2 (dbsp_core.runtime.upgrade), and its input and output
logs are read in place (the step log reads its format-1 segments; dbsp_core.storage.outputlog_format1 reads
the ``DOUT`` output segments).
"""

from __future__ import annotations

import glob
import os

DIRECTORY_FORMAT = 2
PRUNED_FORMAT = 3  # a directory whose stored state keeps fewer columns (META stored_columns not empty)
RANGE_FORMAT = 4  # state may hold range values (DRBR); a superset of 2 and 3 (META stored_columns tells pruned or not)
DIRECTORY_FORMATS = (DIRECTORY_FORMAT, PRUNED_FORMAT, RANGE_FORMAT)  # the directory formats this release reads
# (1: Pipeline.open upgrades it)

META_FILE = "META"
LAYOUT_FILE = "LAYOUT"
RESCALE_FILE = "RESCALE"
REPAIR_FILE = "REPAIR"
LOCK_FILE = "LOCK"
DRIVER_DB = "driver.db"
INPUT_DIR = "input"
OUTPUT_DIR = "output"
STATE_DIR = "state"
JOB_FILE = "JOB"
JOB_INPUT_DIR = "jobs"
CONSUMERS_DIR = "consumers"
CONSUMERS_LOCK = "LOCK"
METRICS_FILE = "METRICS"
PROFILE_FILE = "PROFILE"
SPILL_DIR = "spill"  # batch files of spilled traces (dbsp_core/trace/spill.py)
BATCH_FILE_SUFFIX = ".batch"
TMP_SUFFIX = ".tmp"  # <file>.tmp: an atomic replace's new content before its rename (csrc/smallfile.c, job_files)
NEW_SUFFIX = ".new"  # a log directory's repaired twin (``input.new``, ``output.new``) while REPAIR is in force
REPAIR_BACKUP_PREFIX = "repair-"  # repair-<n>/: what a repair replaced
LOCK_SUFFIX = ".lock"  # <stage database>.lock: flock(2)ed by a stage task attempt
RESULT_SUFFIX = ".result"  # replaces a stage database's ``.db``: the committed attempt's result (DSTR)
WORKER_DB_PREFIX = "worker-"  # worker-<w>.db: a state database, in state/ (embedded) or state/stage-<k>/ (staged)
STAGE_DIR_PREFIX = "stage-"  # state/stage-<k>/: the databases of stage k
FORMAT1_STAGES_DIR = "stages"  # format 1: the staged executor's databases and JOB under stages/

META_MAGIC = b"DMET"
LAYOUT_MAGIC = b"DLAY"
RESCALE_MAGIC = b"DRSC"
REPAIR_MAGIC = b"DRPR"
WORKER_LAYOUT_MAGIC = b"DLWK"
DIVISION_MAGIC = b"DDIV"
DISCARD_MAGIC = b"DDSC"
ZSET_MAGIC = b"DZS1"
FILE_REF_MAGIC = b"DFRF"  # an input-log push naming a unit of an immutable file (storage/fileref.py)
FILE_REF_VERSION = 1  # the JSON body's "version"
BATCH_MAGIC = b"DRB1"
BATCH_GROUP_MAGIC = b"DRBG"
BATCH_REF_MAGIC = b"DRBF"
BATCH_RANGE_MAGIC = b"DRBR"
RANGE_SHARDS = 16  # a DRBR value holds the rows of shards of one aligned block of this many (snapshot.py invariant 11)
ORDER_MAGIC = b"DORD"
DEDUP_MAGIC = b"DDUP"
CLOCK_MAGIC = b"DCLK"
ACKED_MAGIC = b"DACK"
JOB_MAGIC = b"DJOB"
RESULT_MAGIC = b"DSTR"
JOB_INPUT_MAGIC = b"DJIN"
SAVELOG_MAGIC = b"DSVL"
CONSUMER_MAGIC = b"DCSM"
METRICS_MAGIC = b"DMTR"
PROFILE_MAGIC = b"DPRF"
LOG_SEGMENT_MAGIC = b"DLSG"  # a log segment object in an object store (dbsp_core.storage.logstore)
LOG_SEGMENT_SUFFIX = ".dlsg"
FORMAT1_OUTPUT_MAGIC = b"DOUT"  # a record of a format-1 output segment (dbsp_core.storage.outputlog_format1)
STEPLOG_SEGMENT_MAGIC = b"DBSPSSEG"  # the header of a step log segment (csrc/steplog.c)
STEPLOG_RECORD_MAGIC = b"DSLR"  # the frame of a format-2 step log record (csrc/steplog.c)
BATCH_FILE_MAGIC = b"DBSPBTCH"  # the header of a batch file (dbsp_core/trace/batchfile.py)
BATCH_FILE_FOOTER_MAGIC = b"DBSPBTFT"  # its footer
BATCH_FILE_VERSION = 1
BATCH_FILE_GROUPED_VERSION = 2  # row groups (dbsp_core/trace/groupedfile.py): the spill store writes it under
# DBSP_SPILL_GROUPED (trace/spill.py invariant 18) and reads either; the mapped reader (batchfile.open_batch) refuses it
# an output-log part with magic ZSET_MAGIC and this format version names pushes in the input log instead of
# holding rows (dbsp_core/storage/outputlog.py invariant 7; written since 2026-11-28, older builds refuse it)
OUTPUT_REF_VERSION = 3

REMOTE_MANIFEST_DIR = "manifest"  # object-store layout (dbsp_core.storage.remote)
REMOTE_STATE_DIR = "db"
REMOTE_SPILL_DIR = "spill"
REMOTE_LOG_DIR = "log"
REMOTE_WRITER_DIR = "writer"  # one lease object per writer generation (dbsp_core.storage.remote invariant 6)
REMOTE_WRITER_MAGIC = b"DRWL"
REMOTE_DELTA_SUFFIX = ".delta"
REMOTE_BASE_SUFFIX = ".base"
REMOTE_MANIFEST_FORMAT = 1
REMOTE_MANIFEST_MAGIC = b"DRMF"
REMOTE_DELTA_MAGIC = b"DRDL"
CACHE_MARKER = ".dbsp-cache"  # in a cache directory of an object-store pipeline: it may be wiped

DIVISION_HANDLE = "\x00division"  # the input log's handle of division records
DISCARD_HANDLE = "\x00discard"  # the input log's handle of discard records (Pipeline.discard)
SNAPSHOT_TABLE = "snapshot"
SNAPSHOT_NEXT = b"next"
SNAPSHOT_LAYOUT = b"layout"
DEDUP_TABLE = "dedup"
CLOCK_TABLE = "clock"
CLOCK_KEY = b"now"
ACKED_TABLE = "acked"
ACKED_KEY = b"since"
SAVELOG_TABLE = "stagelog"


def trace_table(node_id: int, attr: str) -> str:
    """The state table of trace attribute ``attr`` of node ``node_id``."""
    return f"s{node_id}.{attr}"


def zset_table(node_id: int, attr: str) -> str:
    """The state table of Z-set attribute ``attr`` of node ``node_id``."""
    return f"z{node_id}.{attr}"


def is_state_table(name: str) -> bool:
    """Whether table ``name`` of a state database holds operator state (values keyed by shard)."""
    return len(name) > 1 and name[0] in "sz" and name[1].isdigit()


def order_key(table: str) -> bytes:
    """The key of a trace table's order record in table ``snapshot``."""
    return b"order." + table.encode("utf-8")


def state_db_path(root: str, stage: int | None, worker: int) -> str:
    """The state database of ``worker`` (of ``stage`` for the staged executor, None for the embedded one).

    >>> state_db_path("/data/pipe", None, 2), state_db_path("/data/pipe", 1, 0)
    ('/data/pipe/state/worker-2.db', '/data/pipe/state/stage-1/worker-0.db')
    """
    if stage is None:
        return os.path.join(root, STATE_DIR, worker_db_name(worker))
    return os.path.join(root, STATE_DIR, stage_dir_name(stage), worker_db_name(worker))


def worker_db_name(worker: int) -> str:
    """The file name of ``worker``'s state database (in state/, state/stage-<k>/, or format 1's places)."""
    return f"{WORKER_DB_PREFIX}{worker}.db"


def worker_of_db(path: str) -> str:
    """The worker number of a state database's path, as written in its name (:func:`worker_db_name`)."""
    return os.path.basename(path)[len(WORKER_DB_PREFIX):-len(".db")]


def stage_dir_name(stage: int) -> str:
    """The directory of ``stage``'s databases (under state/, or format 1's stages/)."""
    return f"{STAGE_DIR_PREFIX}{stage}"


def lock_path(db_path: str) -> str:
    """The lock file a stage task attempt flock(2)s beside its stage database."""
    return db_path + LOCK_SUFFIX


def result_path(db_path: str) -> str:
    """The result file of the committed attempt beside a stage database.

    >>> result_path("/p/state/stage-1/worker-0.db")
    '/p/state/stage-1/worker-0.result'
    """
    return db_path[:-len(".db")] + RESULT_SUFFIX


def worker_files(db_path: str) -> list[str]:
    """A state database and the files a stage task keeps beside it."""
    return [db_path, lock_path(db_path), result_path(db_path)]


def job_path(root: str) -> str:
    """The staged executor's JOB record."""
    return os.path.join(root, STATE_DIR, JOB_FILE)


def job_input_dir(root: str) -> str:
    """The directory of a job's stage-0 input files."""
    return os.path.join(root, STATE_DIR, JOB_INPUT_DIR)


def job_input_path(root: str, worker: int) -> str:
    """The stage-0 input file of ``worker``.

    >>> job_input_path("/p", 1)
    '/p/state/jobs/worker-1.input'
    """
    return os.path.join(job_input_dir(root), f"worker-{worker}.input")


def state_db_paths(root: str) -> list[str]:
    """Every state database under ``root/state`` (embedded and staged), sorted."""
    dbs = worker_db_name("*")
    return sorted(glob.glob(os.path.join(root, STATE_DIR, dbs))
                  + glob.glob(os.path.join(root, STATE_DIR, stage_dir_name("*"), dbs)))


def segment_name(number: int) -> str:
    """The file name of step log segment ``number`` (csrc/steplog.c): 20 digits and ``.seg``."""
    return f"{number:020d}.seg"


def is_segment_name(name: str) -> bool:
    """Whether ``name`` is a step log segment's file name (:func:`segment_name`)."""
    return len(name) == 24 and name.endswith(".seg") and name[:20].isdigit()
