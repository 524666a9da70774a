"""The batch store: a memory budget over the traces of a pipeline, kept by spilling their biggest, oldest batches to
batch files (dbsp_core/trace/batchfile.py) that are read in place through a byte-budgeted cache of mapped pages.

Design (trace invariant 12, enforced here and at the seam in dbsp_core/trace/levels.py, ``Trace._read``):

 12. Spilling (a :class:`BatchStore` in force, see :func:`spilling`): every trace read or inserted into on a
     thread with a store in force registers with it. Between steps (the executor calls :meth:`BatchStore.enforce`
     while no worker runs) the store adds up the bytes in memory of every registered trace's batches; while the
     sum is above the budget's share for batches (``memory_limit * BATCH_SHARE``), it spills loose batches
     (placed, not the input of a merge in progress: a merge cursor holds its inputs' buffers), highest level
     first and biggest first within a level: the big, old levels go to disk, the small recent ones stay, so a
     step's inserts and the merges of the low levels touch memory only. A spilled batch is written as a batch
     file (immutable once renamed into place), mapped, and the batch object is switched in place to the
     mapping's buffers: the same object, the same content, so levels, placement numbers, key indexes, shard
     cuts (by ``id``), rollback snapshots and checkpoint records see no change, and every operator reads it as
     before, through the C kernels, with no per-row Python. Reads touch only the pages they need: seeks go through
     the fence kept in memory (csrc/lookup.h), and ``Trace.lookup``/``key_sums`` first ask the batch's Bloom filter,
     so a step that changes k keys touches O(k) pages of a spilled batch, not the batch.
     A batch of at least ``ASYNC_BYTES`` (the output of a merge of big levels, say) is written by the spill
     thread instead, off the step (a 1k-row step that installs a merged level must not wait for its file):
     ``enforce`` hands it over and counts its bytes as gone; a later ``enforce`` (between steps) switches it to the
     file once written, or deletes the file when the batch was merged away meanwhile; a write's error is raised
     by that ``enforce``. Until then the batch is read from memory as before: the budget is exceeded by the
     batches not written yet (and the inputs in memory of a background compaction, levels.py invariant 16, whose
     output is on its way to a file: counted as gone within the same share), at most ``ASYNC_SHARE`` of the limit (or the one batch being handed over): beyond
     it ``enforce`` waits for the writes first (:meth:`BatchStore.settle`, which also switches them). Writes
     through a VFS not in ``ASYNC_VFS`` (the fault-injecting one of crash tests, unless a test adds it) stay on the
     calling thread, so their I/O order is the step's.
     A merge is paid for in memory only when its output fits what the budget has left (:meth:`BatchStore.merge_dir`:
     its inputs' bytes, an upper bound of its output's, against the batch share less the bytes in memory at the last
     ``enforce`` and the merges started in memory since); a bigger one (from ``FILE_MERGE_MIN`` bytes on) builds
     its output in a shared mapping of an unlinked scratch file in the store's directory, and every DROP_ROWS input
     rows (levels.py ``_Merge.step``) the pages it wrote and the pages it read of spilled inputs leave the process
     (madvise: the written ones stay the file's, in the page cache, which writes them back). When it finishes, the
     output is spilled (:meth:`BatchStore.spill_output`) at the end of the insert's merge work (levels.py
     ``Trace._work``): with ``IN_PLACE`` (through the store's VFS, posix or the fault-injecting one alike: each
     write, truncate, hole, fsync and rename an operation it counts and can crash or fail) the scratch file, which
     the merge built with room for
     the batch file's header and Arrow metadata before its rows (:meth:`BatchStore.merge_room`), becomes the batch
     file in place, its rows never copied (batchfile.py invariant 7); else its batch file is streamed from the
     scratch mapping a piece at a time (batchfile.py ``write_batch``); so neither the merge nor its spill holds the
     output in memory; an output that a merge of
     the level above took in and finished within the same work (a big step's merges cascade up the levels) is
     never written (``outputs_never_written``). A merge in memory's output written so far counts in the budget
     (``merge_bytes``); a smaller output is spilled, if need be, by a later ``enforce``. A file is deleted when its batch object is gone (merged
     away, dropped); its blocks and page cache are given back by the enforces after that, ``RECLAIM_BYTES`` each
     (:meth:`BatchStore._reclaim_files`: a descriptor kept across the unlink, the file truncated from its end once no
     mapping of it is alive in the process, its batch's or any other: every mapping of a batch file is registered,
     batchfile.py invariant 9, and the kernel's list of mappings is asked before a file's first piece, ``RECLAIM_CHECK``;
     never a file whose inode another name still links once its own name is gone, a copy made with hard links: its
     bytes are that name's), not at once by the step that drops it: the kernel frees a file at ~30 us a MiB, and the install of
     a compaction drops all its inputs (650 MB for 20M rows: 34 ms). While a store lives, the C region cache (freed merge buffers kept for reuse, csrc/scratch.h)
     keeps at most ``memory_limit * REGION_CACHE_SHARE`` bytes, and each thread's scratch cache (kernels' freed
     buffers, 512 MiB a thread otherwise) at most ``memory_limit * SCRATCH_SHARE``.
     The cache: the pages of mapped files that reads touched are resident (the OS page cache, file-backed and clean: the
     kernel can drop them at any time). The store bounds them too, page by page (``mmap.PAGESIZE``): a read of some
     keys in a spilled batch (``Trace.lookup``, ``key_sums``, ``narrowed`` for ``match_weights`` and the join walks
     over ``Trace.walked``) reports the pages it reads (:meth:`BatchStore.note_pages`: from the fence in memory, the
     key-hash pages its seek reads and the pages of the rows it finds or, for a walk, of the rows the fence places
     each key among: ``BatchFile.pages_read``); any other read of a trace (``Trace._read`` without ``pages``: it may
     touch any row) uses every page of its spilled batches. ``enforce`` adds the pages used since the last one to
     the cache, stamped with its count (a clock per page of each file, 4 bytes per 4 KiB); when the cache holds more
     than :meth:`BatchStore.cache_cap` bytes (what the budget has left beside the bytes in memory at that enforce,
     batches, merge outputs, fences and filters, and at least ``memory_limit * CACHE_SHARE``: the batch share is a
     ceiling for batches, not a reservation, so a state whose batches are all spilled gives the cache nearly all of
     the budget), the pages of the oldest reads not used since are evicted (madvise(MADV_DONTNEED) over each run of
     adjacent pages, in C without the GIL, up to 1024 runs a system call (``_storage.advise_pages``:
     process_madvise, or a madvise per run on a kernel that refuses it): they leave the process; a later read faults
     them back from the page cache or the disk). An eviction of a file's pages in ``WHOLE_RUNS`` runs or more is
     one madvise over the file's whole mapping instead: the kernel's work per run (a TLB flush, 1-2 us here) was
     most of a warm step, where a whole clean mapping goes at ~0.1 us per mapped page (the pages around faults
     included); the pages the cache still holds leave the mapping too but stay counted as held (a read faults them
     back from the page cache, a minor fault), so the accounting, hits and misses included, is the per-page clock's
     either way. So a step's working set (O(changed
     keys) pages) stays cached across steps however big the files, and a file's other pages never count. The
     accounting costs the step a few numpy operations per spilled batch read and the kernel's work per run of pages
     evicted. A read fault maps besides its page the page-cache pages of the aligned 64 KiB around it (the kernel's
     fault-around), which no read counted, so the files' mappings hold several times the cache's pages (clean pages
     the kernel may take back: a 10M-row join under 100 MiB, 175 MiB against the cache's 25; bench/history/RESULTS-2026-11-28-to-2026-12-02.md,
     2026-11-29). With ``EVICT_AROUND`` an eviction drops the pages of those 64 KiB too, but for the pages the cache
     holds (``_around``): the mappings then hold the cache's pages and at most the rest of their 64 KiB (108 MiB
     there), and steps fault more. Newer kernels (Linux 6.18 here) map the whole page-cache folio a fault lands in
     (up to 2 MiB, with one PMD entry when it is 2 MiB and aligned), and batch files are written so that most of them
     is (batchfile.py invariant 6): a fault then maps 2 MiB and a drop unmaps it as one entry, at a fraction of the
     kernel's cost per page of smaller folios (bench/history/RESULTS-2026-11-28-to-2026-12-02.md, 2026-11-29, branch r31-pread); the mappings then hold
     the 2 MiB around every page read (a 10M-row join under 100 MiB: ~390 MiB of its 878 MiB of files between two
     whole drops, 385 MiB with the files written before): clean pages the kernel may take back, but RSS (``ps``, a
     container's view) counts them. A merge of spilled inputs drops their pages when it drops its own
     (``merge_pages_out``).
     Mapped pages count against the budget (``BOUND_MAPPED``): what the budget bounds after every ``enforce`` is the
     bytes in memory (batches, merge outputs, fences and filters: ``memory()``) plus the pages of spilled files and
     key indexes mapped into the process. The store counts a spilled file's mapping in ``MAP_UNIT``s (2 MiB of
     address space: one page table, the most a read fault maps, whether it maps a 2 MiB folio with one PMD entry, a
     smaller folio whole or its fault-around window): a unit is marked when a read uses a page in it (the same
     pages the cache counts) and unmarked when the file's mapping is dropped whole. After the cache's eviction,
     while the marked units (``MAP_UNIT`` each) and the key indexes the cache holds come to more than
     :meth:`cache_cap`, ``enforce`` drops whole mappings, the file read longest ago first (``_bound_mapped``; the
     pages the cache holds stay counted as held, as for a whole eviction): so the files' Rss is at most
     ``mapped_bytes()`` <= ``cache_cap()``, and with the bytes in memory at most ``memory_limit`` (or, when those are
     over the batch share because merges or writes are in flight, those plus ``CACHE_SHARE`` of it). A file's
     mapping is dropped once it is opened (``_switch``, ``adopt``: what opening read), so no page is mapped that no
     read counted, but for these, the slack the bound does not count: the pages a merge read of its spilled inputs
     since its last drop (``DROP_ROWS`` input rows, about 2 MiB per column and input when folios are 2 MiB), and
     a step's own reads until its ``enforce``, ``MAP_UNIT`` per unit read (a 1k-row step on a 10M-row join read ~190
     units, ~380 MiB). With ``WALK_IN_PIECES`` (off by default: it costs the steps CPU, see there; on for walks of ``WALK_PIECES_FROM``
     change rows or more, a big step's, whatever it says) those are
     bounded within the step too for the walks that read most: a join's walk
     (operators/join.py ``inner_change``), ``match_weights`` and ``key_sums`` walk a spilled batch in pieces of the
     change (key-hash order: each piece reads its share of every column, ``Trace.in_pieces``), as many as
     :meth:`walk_pieces` says (each piece maps about ``PIECE_SHARE`` of the limit, at least a unit per column, at most
     ``MAX_PIECES`` pieces), and drop the batch's mapping after each (:meth:`walked_out`: its units then count as not
     mapped at the next enforce unless read again before it); the bound is across a thread's walks, not per file: the
     files walked in one piece each (a tiered level's, each under a piece) stay mapped until they and the next file
     would map more than a piece, then are dropped first (a walk is big by its whole change's rows, not the rows each
     file's filter leaves); so such a step maps at most about what the last enforce
     left, a piece and a unit per column where two pieces meet; ``Trace.lookup`` and whole reads are not in pieces
     (their slack is what they map). Reads outside
     a step must go through the store or not touch a spilled batch's pages (metrics' shard bytes use the fence:
     ``IndexedZSet.shard_bounds(near=True)``). The cost: the steps fault back the units the drop took, one minor
     fault per 2 MiB folio (bench/history/RESULTS-2026-11-28-to-2026-12-02.md, 2026-11-29, branch r31-rss).
     Recency: the mappings are MADV_RANDOM (a fault reads no pages around it from the disk), and under that advice
     Linux takes no notice of the mapping's accesses: unmapping a young page does not mark its page-cache folio
     accessed, and reclaim's reference scan skips the mapping (``vma_has_recency``). So every drop of a spilled file's
     pages (an eviction, a whole-mapping drop, a merge's ``merge_pages_out``, a walk piece's ``walked_out``: all through
     ``_drop_mapping`` or ``_evict``; an enforce's evictions through ``spillread.evict``, the same calls in one C
     call) is made with the mapping MADV_NORMAL and sets it MADV_RANDOM again after
     (``_recency``, two madvise calls per mapping dropped; ``RECENCY``): the pages reads used since the last drop are
     marked used in the LRU, so under memory pressure the kernel reclaims the files steps do not read (a join's side
     that only grows) before the ones every step reads. Without it, at 100M rows under 1 GiB (files 12 GiB on a 23 GiB
     host shared with other work) the files a join step reads, written first, were reclaimed first and came back one
     page at a time, in order-0 folios: a fault then maps 16 pages around its page a PTE each, 5x the kernel's cost of
     a page in a 2 MiB folio (the same steps replayed: 19-21 ms a step in 16 KiB folios, 3.7 in 2 MiB ones, 36-56 on
     the store's own files; bench/history/RESULTS-2026-11-28-to-2026-12-02.md, 2026-11-29, branch r31-fault100); with it the hot files kept their
     2 MiB folios in two of three runs (the LRU took their unread row hashes instead): 5.9-6.7 ms CPU a step against
     29-33 on main, whose hot files degraded in both of its runs. A thread that faults a page of the
     mapping during those two calls gets the kernel's read-around (read_ahead_kb of the disk): a cost, not an error.
     Huge faults (``HUGE_SHARE``): recency lowers the odds that the hot files lose their folios, but any drop of them
     from the page cache (the host's reclaim, a cold start, ``fadvise``) has MADV_RANDOM faults bring them back one
     4 KiB page at a time, for good: a 10M join under 100 MiB, its files dropped, then took 2,900 faults and 33 ms of
     system time a step against 160 and 1-2 ms in 2 MiB folios (bench/history/RESULTS-2026-11-28-to-2026-12-02.md, 2026-12-02, branch r31-100). So an
     enforce that finds the reads of some keys since the last one used at least ``HUGE_SHARE`` of a file's 2 MiB units
     (``_hot_files``: a file that most steps read most units of, where reading whole units costs little more than the
     pages themselves) sets MADV_HUGEPAGE on the file's mapping, once: under it a fault on a page the page cache
     does not hold reads its aligned 2 MiB as one folio (the kernel's VM_HUGEPAGE fault path, MADV_RANDOM or not),
     so the file returns to 2 MiB folios as the steps read it, and :meth:`prefetch` skips it (a WILLNEED reads 4 KiB
     folios). A file steps read sparsely (a state far beyond the page cache, a few keys a unit) never gets it: its
     faults read their pages alone, as before.
     Next step, measured and not built: reads through pread(2) for files whose pages sit in small folios or whose
     reads find few pages per 2 MiB (the same 100M steps: pread 5.3 ms a step in 2 MiB folios, 7.6-8.1 in 16 KiB ones,
     6.7-7.4 on the store's files; at 10M, 30 pages a unit, the mapping wins 8x). It changes how rows reach the
     kernels: today a spilled batch's Arrow buffers are the mapping (``_switch``) and every C kernel (csrc/lookup.c
     seeks, the join walk, ``key_sums``, ``match_weights``, merges) reads them in place, so a pread path must hand the
     kernels an in-memory batch of the rows they will read instead: for a read of some keys (``Trace.narrowed``,
     ``lookup``, ``key_sums``), gather, in C without the GIL, the fence blocks of the sought hashes (one pread each,
     runs merged), the rows whose hashes match, and those rows of each column (a pread per run of rows), into a small
     batch the walk reads in place of the spilled one (the join's ``inner_change`` then walks the gathered batch); the
     pages it read are counted as now (invariants 12 and 15), a lazily opened file's pages are checked per 64 KiB page
     read (invariant 14), columns of variable width, nulls and row hashes handled; whole reads (merges, a key index
     build) keep the mapping. The store picks per file: pread while the file's reads find few pages per ``MAP_UNIT``
     (the marks it keeps already) and the mapping maps small folios (its smaps FilePmdMapped against Rss, sampled).
     Prefetch: a read of some keys names its pages before it walks (the same fence in memory), so ``Trace.lookup``,
     ``key_sums``, ``match_weights`` and the join walks (``Trace.walked`` with the change's key hashes) first call
     :meth:`BatchStore.prefetch` for every spilled batch they will seek: a madvise(MADV_WILLNEED) per run of the
     pages its filter-passed keys read (batched as the evictions) and the cache does not hold, in C without the GIL, which starts their reads
     and returns; the walks then find the pages in the page cache (or being read) instead of waiting for each
     fault in turn, so a cold step waits for about one disk round trip instead of one per page. It is done while
     the files do not fit the page cache (``PREFETCH`` "auto": the last step read pages from the disk, measured by
     ``enforce``, at least ``PREFETCH_FROM`` and ``PREFETCH_SHARE`` of the pages its lookups missed in the cache);
     when they do, a step's pages are minor faults and the calls would cost it for nothing (a few pages the host took
     back from a warm step do not turn it on).

 13. Checkpoints name files, not rows (a durable pipeline's store: files under ``<storage>/spill``, fsynced with
     their directory before the batch is switched to them, so before any checkpoint can name them): a checkpoint
     saves a spilled batch as one small reference per shard (file name and row range, dbsp_core/storage/snapshot.py
     invariant 8) and pins the file; a restore reads the batch in place from the file. A file is deleted only when
     no live batch reads it and no checkpoint that may still be opened names it: after the next checkpoint that
     does not name it has committed on every worker, or, after a crash, by the sweep of the next open, which
     keeps exactly the files the opened checkpoint names. A crash between a file's write and the checkpoint that
     names it leaves a file nobody names (swept); a crash during a checkpoint leaves the previous one, whose
     files are still pinned and present. A closed store (the pipeline closed, or shut down after a failure) deletes
     nothing more: a batch of it that the collector frees later (a broken pipeline's objects in a reference cycle)
     leaves its file to the next open's sweep. After a failure the store's pins may not be the checkpoint that
     committed (a crash that kept a checkpoint's commit but failed its caller), and the directory is unlocked at
     the close, so a pipeline reopened on it in the same process may have adopted the very files a late deletion
     would remove; nor may a late deletion take an I/O operation of another pipeline's VFS.

 14. Opening reads metadata, not rows (batch file invariant 5): a batch a checkpoint names is adopted from its file
     opened lazily (header, footer and page CRCs checked; fence and filter read in place), and the store keeps it
     in ``_unchecked`` until every byte a read may touch has been checked. The trace asks the store first
     (``Trace._read``, the seam): :meth:`BatchStore.check` before a read that may touch any row (a walk, a merge,
     a key index build: the file is checked whole, once), and for a lookup of some keys in a whole file's batch
     :meth:`BatchStore.check_seek` and :meth:`BatchStore.check_rows` (the fence and filter, then the key-hash
     pages the fenced seek reads, then the pages of the rows found), so the first steps after an open check what
     they read and no more. A check that fails raises CorruptionError naming the file and ``dbsp repair``; the
     step that read it fails before any row of the file is used.

 15. The cache's counters, per trace (``"<operator>.<trace>"`` in ``Pipeline.metrics()["spill"]``), in pages: each
     page a read of a trace uses (invariant 12: the pages of the keys it seeks, or every page of a batch it reads
     whole) counts a hit when the cache holds it (used before and not evicted since: mapped in, or at least in the
     page cache) and a miss when not (evicted, or never read since the batch was spilled or opened: it comes from
     the page cache or the disk). The pages are the engine's account of what a read touches (a key's fence block
     of key hashes, its rows' bytes); the kernel, not the engine, knows which of them fault.
     Overflow (``OVERFLOW_EMPTIES``): an enforce whose reads marked more ``MAP_UNIT``s than :meth:`cache_cap` (a
     step's pages at random keys land in a unit each: the 10M join under 100 MiB read ~190 units, 380 MiB, against a
     cap of 29-44 MiB) would drop every mapping they read and every older one (invariant 12, "mapped"), so the cache
     could keep none of them mapped; it then skips the per-page clock (stamps, rounds, the oldest-first eviction:
     0.43-0.46 ms a step there, bench/history/RESULTS-2026-11-28-to-2026-12-02.md, r31-share) and empties: every page those reads used counts a miss,
     the cache holds no page after it (clocks and rounds dropped, ``cached_pages()`` 0), and the mappings go
     (``stats["overflows"]`` counts such enforces). Hot units (``OVERFLOW_KEEP``, :meth:`_keep_hot`): of the units of
     format-1 files mapped at that enforce (read since the last one, or kept by it), those with the highest heat stay
     mapped, at most :meth:`cache_cap` of them, and stay marked (so ``mapped_bytes()`` and the next enforce count
     them: the bound of invariant 12, "mapped", is the same); every other unit of those files is dropped, a
     madvise(MADV_DONTNEED) per run of units with the mapping's recency (``_drop_units``). A unit's heat (``_heat``,
     a byte per unit of a file) is halved at each overflowing enforce and gets 128 when reads since the last one used
     it, ties going to the unit more pages were read in: a unit most steps read (a key-hash column's, where ~1,000
     keys a step land in most of its units) is kept before one read now and then. At 100M rows under 1 GiB every
     step overflows (1,000-1,700 units read against room for ~400): without the keep each step faulted all its units
     back, a 2 MiB PMD fault and a drop each (~3-5 us with the user time the fault's return costs); with it the
     units kept and read again fault no more (bench/history/RESULTS-2026-11-28-to-2026-12-02.md, 2026-12-02, branch r31-fault). Format-2 files and
     files a walk dropped after its last read (``walked_out``) are dropped whole, as before. So in a state whose
     steps overflow the cache, ``cache_hits`` stay 0 and ``cache_misses`` are every page read (a page in a kept unit
     too: the kept units are the mapped bound's, not the clock's), where the clock counted as hits the pages read
     again that it still held in the page cache (5-8% of them there; they faulted back all the same: the mapping had
     been dropped). A key index the cache counts keeps the clock (its pages go in the clock's order).

 16. Every read of some keys in a spilled batch (``Trace.lookup``, ``key_sums``, ``match_weights``, an inner join's
     walk, through ``Trace.narrowed``) first drops the keys the batch's Bloom filter rules out, and counts those it
     seeks in ``stats["keys_sought"]``: each costs at least a page of the batch's key hashes, so a step that changes
     k keys seeks about k times the batches that hold them (plus the filter's ~2% false positives), not k times
     every spilled batch. A filter is in memory only once a read has probed it (``LAZY_FILTERS``): ``_switch`` lets
     go of the copy the writer built (batchfile.py ``BatchFile.release_filter``) and the first probe copies it back
     from the file's mapping, fence and filter checked against their section CRC first (batchfile.py invariant 5),
     so a trace whose keys no step seeks (a join's side that only grows, whose changes no other side's walk looks
     up) holds no filter in the budget; the probed ones are held as before (``memory()``: ``filter_held``).

 17. Key indexes live in files too (csrc/keyindex.h invariant 7): a registered trace's key index keeps its large
     regions (a slot table or entries from 2 MiB) in unlinked files of the store's directory, so its pages are the
     page cache's, not the process's. The cache counts a trace's index as its ``nbytes`` in pages, all used when
     the trace is read in any way (which pages its probes touch is not known), stamped with the cache's clock like
     a read's pages and evicted whole in the same oldest-first order; evicting it drops its pages (``KeyIndex.drop_pages``, on the thread calling
     ``enforce``, between steps: no step reads or grows the index meanwhile), and the next probes fault back the
     pages they touch, O(keys probed). Whatever an index holds, the memory it pins is bounded by the cache share.
     An index past ``INDEX_MAX_SHARE`` times the cache share and past ``INDEX_KEEP_BYTES`` is not kept at all
     (keyindex.py ``_weigh_index``: the
     trace drops it for good, quietly, and walks its batches, the spilled ones through their filters and fences,
     invariant 16): a step's probes land all over it and write what they find, so an index the cache cannot hold is
     evicted every enforce and costs every step a write fault per page probed (a shared file mapping: ~5 us each, where
     a read fault on an immutable batch file maps a page in ~0.3 us).

 18. Batch file format 2 (``GROUPED_FROM``, ``DBSP_SPILL_GROUPED``; off by default): a batch of at least
     ``GROUPED_FROM`` bytes whose columns are all of types a row group bounds (groupedfile.py invariant G4) is spilled
     (by ``enforce``, the spill thread, or a merge built on disk, whose output is then copied from its scratch
     mapping instead of made in place) to a format-2 file (row groups read by pread, groupedfile.py) and becomes a
     grouped batch (groupedbatch.py invariants B1-B3): the same object, its rows in the file only. Reads of some keys
     (``Trace.walked``, ``lookup``, ``match_weights``, ``key_sums``) read the rows of those keys by one C call a
     batch (the Bloom filter, the group index, a pread a run of groups: ``stats["grouped_lookups"]``,
     ``keys_sought`` counts every key asked; while :meth:`prefetching` says the last step read from the disk, a
     posix_fadvise(WILLNEED) a run of groups first, so a cold step's reads overlap: ``grouped_prefetched``; the
     pages of the groups a lookup read, each at the file's average group size, count as pages the step's reads
     missed in the cache, so the rule's ``PREFETCH_SHARE`` weighs a format-2 step's pages from the disk against what
     it read as it does format 1's), into a
     small batch in memory the C kernels walk as any other. Those reads are in place from a mapping of the file kept
     between steps (groupedfile.py invariant G5, ``DBSP_SPILL_GROUPED_MAP``; by pread when ``prefetching`` says the
     file is cold): each lookup flags the ``MAP_UNIT``s it read, and each enforce takes them (``_grouped_units``) and
     counts them with format 1's marks in the mapped bound (invariant 12, "mapped": ``_bound_mapped`` and the
     overflow drop the file's mapping whole, ``_mapping_to_drop``), so the budget bounds a format-2 file's mapped pages
     as a format-1 file's; they use none of the cache's per-page clock (invariants 15 and 16 are format 1's).
     Back-off: a format-2 file whose mapping the bound drops reads by pread for the next ``MAP_BACKOFF`` enforces,
     then maps again (``grouped_map_backoffs`` counts them), unless its reads since the last enforce found
     ``MAP_GROUPS_PER_UNIT`` groups a unit or more (a fault then serves that many groups' preads): when a step's units do not fit the cap (a 1k-key step on
     a 10M-row join under 100 MiB reads ~250 units, 500 MiB, against a cap of 30-60), a mapping dropped every
     enforce costs each step a fault a unit and keeps nothing (bench/history/RESULTS-2026-11-28-to-2026-12-02.md, r31-f2map: ~280-600 faults,
     0.4-3 ms of sys a 1k-key read as the file's page cache is in 2 MiB folios or smaller ones, against ~1.1-1.4
     ms by pread), where a mapping the cap holds reads with no fault and no copy (~1.3 against ~2.2 ms a read). A read of every row (a merge's input, a key
     index build, a shard cut) copies the rows into memory: the copy counts as bytes in memory and the next
     ``enforce`` empties it. A merge with a grouped input does not: it streams it (groupedmerge.py invariants
     S1-S3: each file's groups read in order, a ``groupedmerge.WINDOW`` at a time, merged round by round with the C
     merge, the output, when ``merge_dir`` puts it on disk and the VFS is one of ``ASYNC_VFS``, written to a
     format-2 file as it goes and adopted by :meth:`adopt_merged`; else kept in memory, as a merge in memory's);
     ``merge_bytes`` counts what it holds (its windows, its output in memory, its writer's metadata). A checkpoint names a format-2 file
     as it names a format-1 one (invariant 13), its shard bounds from the group index and the groups they fall in;
     a restore of a whole file reads its metadata only (``adopt_grouped``), a restore of part of one copies those
     rows. A store holds files of both formats and reads whichever a batch lives in, whatever the switch says. The
     C decoder's read buffer (csrc/groupdecode.c, 32 MiB a thread at most) is bounded while a store is open:
     ``SCRATCH_SHARE`` of the limit a thread, as the scratch cache.
     What it costs: the write is ~2-6x format 1's CPU (pyarrow's serialize a group; a load 1.5-2.6x format 1's),
     and a warm step more CPU than format 1's (by pread +13-69%, a pread and a copy a key's group; mapped, see
     bench/history/RESULTS-2026-11-28-to-2026-12-02.md r31-f2map); so
     ``GROUPED_FROM`` is for the large, cold levels (bench/history/RESULTS-2026-11-28-to-2026-12-02.md, branches r31-wire2, r31-stream and r31-f2,
     have the measures behind the choice).

What is not spilled: pending batches (those of a trace restored and not read since) while the loose batches meet the
budget; beyond that ``enforce`` places them, ending the trace's freshness as a first read would, and spills them as
loose ones (levels.py invariant 5: freshness protects a restore, which is over once a trace's load returns, and
``enforce`` runs between steps, never inside a load: a staged task's load calls it only after each trace is
restored, runtime/stage_task.py ``_placed``). Merge inputs (until the merge ends), Z-set state of operators that is
not a trace, and the per-batch fence and filter (about 1.4 bytes per row). A batch file is streamed through the
store's VFS, posix or the fault-injecting one alike (batchfile.py invariant 1): spilling a batch never holds a second
copy of it.
"""

from __future__ import annotations

import mmap
import os
import queue
import resource
import shutil
import tempfile
import threading
import weakref
from collections import deque
from contextlib import contextmanager, nullcontext
from itertools import chain
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from dbsp_core.envvars import parse_memory_limit, settings
from dbsp_core.progress import progress
from dbsp_core.storage.formats import BATCH_FILE_SUFFIX, SPILL_DIR
from dbsp_core.trace import spillread
from dbsp_core.trace.at_exit import stop_at_exit
from dbsp_core.trace import batchfile, groupedbatch, groupedfile
from dbsp_core.trace.batchfile import BatchFile, InPlaceWrite, in_place_room, open_batch, write_batch, write_in_place
from dbsp_core.trace.groupedfile import GroupedFile, groupable_schema, open_grouped, write_grouped
from dbsp_core.trace.groupedmerge import StreamedMerge
from dbsp_core.trace.threadvalue import ThreadValue

if TYPE_CHECKING:
    from dbsp_core.trace.levels import Trace
    from dbsp_core.zset import IndexedZSet

__all__ = ["BatchStore", "spilling", "current_batch_store", "parse_memory_limit", "batch_bytes", "merge_bytes"]


MERGE_SCRATCH_PREFIX = "merge-"  # scratch files of merges built on disk (unlinked once mapped; a crash may leave one)


class _SharedLimit:
    """A process-wide limit of a C cache (the region cache, each thread's scratch cache) that every open store
    lowers to its share of its budget: the limit is the smallest share of the stores open, and the limit found
    before the first one when none is, whatever order stores open and close in (two pipelines of one process, one
    budgeted and one not, or closed out of order, never leave each other a lowered or raised limit).

    A store never closed gives its share back from a ``weakref.finalize`` callback (:meth:`release_later`), which
    runs wherever the store is collected: on any thread, and on this very thread in the middle of :meth:`hold` or
    :meth:`release` when the garbage collector runs inside their call into C. So it never waits for the lock (seen:
    a test process hung for ever in ``release`` called from ``hold``'s collection, the lock being its own): it
    queues its key, and whoever holds the lock applies the queue before letting it go and looks again after."""

    def __init__(self, name: str, module: str = "_zset") -> None:
        self._name = name  # the function of dbsp_core.<module> that sets the limit and returns the previous one
        self._module = module
        self._lock = threading.Lock()
        self._caps: dict[str, int] = {}
        self._base: int | None = None
        self._gone: list[str] = []  # keys released by finalizers, not applied yet (list.append: atomic)

    def _set(self, limit: int) -> int:
        from dbsp_core import _storage, _zset

        return int(getattr(_storage if self._module == "_storage" else _zset, self._name)(limit))

    def hold(self, key: str, cap: int) -> None:
        with self._lock:
            prev = self._set(cap)
            if self._base is None:
                self._base = prev
            self._caps[key] = cap
            self._set(min([self._base, *self._caps.values()]))
            self._apply_gone()
        self._after()

    def release(self, key: str) -> None:
        with self._lock:
            self._drop(key)
            self._apply_gone()
        self._after()

    def release_later(self, key: str) -> None:
        """:meth:`release` from a finalizer: now if the lock is free, else by the thread holding it."""
        self._gone.append(key)
        self._after()

    def _drop(self, key: str) -> None:
        if self._caps.pop(key, None) is None or self._base is None:
            return
        self._set(min([self._base, *self._caps.values()]))
        if not self._caps:
            self._base = None

    def _apply_gone(self) -> None:  # under the lock; a collection inside _set may queue more: the loop takes them
        while self._gone:
            self._drop(self._gone.pop())

    def _after(self) -> None:
        """Apply keys queued while another thread held the lock (it looks again once it has let it go, so a key
        queued just before that is applied by one of the two)."""
        while self._gone and self._lock.acquire(blocking=False):
            try:
                self._apply_gone()
            finally:
                self._lock.release()


_REGION_LIMIT = _SharedLimit("region_cache_limit")
_SCRATCH_LIMIT = _SharedLimit("scratch_cache_limit")
_GROUPED_LIMIT = _SharedLimit("grouped_keep_limit", "_storage")  # the format-2 decoder's read buffer a thread keeps


def _release_limits(token: str) -> None:
    _REGION_LIMIT.release(token)
    _SCRATCH_LIMIT.release(token)
    _GROUPED_LIMIT.release(token)


def _release_limits_later(token: str) -> None:
    """A store collected without close(): its shares back, never waiting for a lock (``_SharedLimit.release_later``)."""
    _REGION_LIMIT.release_later(token)
    _SCRATCH_LIMIT.release_later(token)
    _GROUPED_LIMIT.release_later(token)


def merge_bytes(m: Any) -> int:
    """Bytes of a merge's output held in memory (levels.py ``_Merge``): its inputs' bytes (an upper bound) in
    proportion to the input rows consumed, for an output built in a scratch file only those consumed since its
    pages last left the process (``m.dropped``, invariant 12); and the sections its file's writer holds while it
    writes it in pieces (batchfile.py invariant 8)."""
    c = m.cursor
    if isinstance(c, StreamedMerge):  # (its windows, its output in memory or its writer's: groupedmerge.py S1)
        return c.held_bytes()
    ins = [e[1] for e in m.inputs]
    rows = c.consumed - (m.dropped if c.mapping is not None else 0)
    w = getattr(getattr(m, "shared", None), "writer", None)  # its file being written in pieces: filter, fence, CRCs
    return int(sum(batch_bytes(x) for x in ins) * rows / max(1, sum(len(x) for x in ins))) + (
        w.memory_bytes() if w is not None else 0)


def batch_bytes(b: "IndexedZSet") -> int:
    """Bytes a batch holds in its buffers: rows, weights, key hashes and the row hashes it keeps (a batch spilled to a
    format-2 file: those it held then, invariant 18)."""
    if groupedbatch.is_grouped(b):
        return groupedbatch.spilled_bytes(b)
    z = b.zset
    n = int(z.data.nbytes) + int(z.weights.nbytes) + int(b.key_hash.nbytes)
    if b._rh is not None and b._rh is not b.key_hash:
        n += int(b._rh.nbytes)
    return n


class BatchStore:
    """The memory budget of a pipeline's traces and the batch files its spilled batches live in (invariant 12).

    Parameters
    ----------
    memory_limit : int
        Bytes the traces' batches and the cache of their spilled pages may hold together.
    directory : str or None
        Where batch files go (created if missing; files left there by an earlier process are removed). None: a
        temporary directory removed by :meth:`close`.
    durable : bool
        Whether files are fsynced (with their directory) before they are used: a durable pipeline's are, so that a
        checkpoint may name them; a temporary directory's need not be.
    vfs : str
        The I/O layer files are written through ("posix", or "fault" in crash tests).

    Examples
    --------
    >>> import pyarrow as pa
    >>> from dbsp_core import ZSet
    >>> from dbsp_core.trace import Trace
    >>> t = Trace(pa.schema([("k", pa.int64())]), ("k",))
    >>> with BatchStore(1) as store, spilling(store):
    ...     t.insert(ZSet.from_rows([(i,) for i in range(100)], t.schema).index_by(["k"]))
    ...     spilled = store.enforce()
    ...     rows = len(t.consolidated())
    >>> spilled > 0, rows, store.stats["files_written"]
    (True, 100, 1)
    """

    BATCH_SHARE = 0.75  # of the limit: batches in memory; the rest: the cache of spilled pages
    CACHE_SHARE = 0.25
    INDEX_FILE_MIN = 2 << 20  # bytes of key index from which its regions are files the cache counts (invariant 17)
    # a trace under the store drops its key index for good once it passes this times the cache share (invariant 17;
    # None: never): a step's probes write pages all over it, so evicted every enforce it costs each step a write
    # fault per page probed (~5 us: a 10M-group group-by under 100 MiB, 16.7 ms a 1k-row step against 5.7 ms walking
    # its spilled batches, bench/history/RESULTS-2026-11-28-to-2026-12-02.md 2026-11-29)
    INDEX_MAX_SHARE: float | None = 1.0
    # ... but an index of at most this many bytes is kept whatever the budget: re-faulting all of it costs a step at
    # most ~4k write faults (~20 ms), and the rule is for the indexes a budget's cache can never hold (hundreds of
    # MiB); a tiny budget (DBSP_MEMORY_LIMIT=1 in CI) then still runs the paths a key index serves
    INDEX_KEEP_BYTES = 16 << 20
    holding = False  # a step runs in pieces (dbsp_core/runtime/substep.py): tiered levels take HOLD_FAN_IN loose
    # batches before they merge (levels.py invariant 15), so that the pieces' files merge once, at the step's end
    FILE_MERGE_MIN = 1 << 20  # input bytes from which a merge that does not fit the budget is built on disk
    REGION_CACHE_SHARE = 0.125  # of the limit: the most the C region cache (csrc/scratch.h) keeps while a store lives
    SCRATCH_SHARE = 0.0625  # of the limit: the most each thread's C scratch cache keeps while a store lives (512 MiB
    # a thread otherwise: a one-push load's pieces left ~50 MiB of it at 10M rows under 100 MiB, bench/history/RESULTS-2026-11-28-to-2026-12-02.md
    # "A one-push load under the budget")
    PROGRESS_BYTES = 256 << 20  # an enforce spilling this much shows a progress line (dbsp_core/progress.py)
    # bytes from which a spilled batch's file is written in format 2 (row groups read by pread, invariant 18; None:
    # never, format 1 only): DBSP_SPILL_GROUPED (envvars.py), off by default
    GROUPED_FROM: int | None = settings().spill_grouped
    # enforces a format-2 file reads by pread after the mapped bound dropped its mapping (invariant 18, "back-off"): a
    # file whose reads' units the cap cannot hold pays a fault a unit each step for nothing kept (its mapping dropped
    # every enforce), where pread costs it no fault; after them its lookups map again, to find out whether they fit
    MAP_BACKOFF = 16
    # ... unless its reads since the last enforce found at least this many groups a unit: then a fault a unit costs
    # less than a pread a group even with the mapping dropped every enforce (bench/history/RESULTS-2026-11-28-to-2026-12-02.md, r31-f2map: 2M rows,
    # ~20 groups a unit, 2.5 ms CPU a join step mapped against 3.6 by pread; 10M rows, ~4, about even)
    MAP_GROUPS_PER_UNIT = 8
    ASYNC_BYTES = 64 << 10  # a batch this big is written by the spill thread, off the step (invariant 12); below it
    # a write takes a few ms and stays on the calling thread
    ASYNC_VFS = ("posix",)  # VFSes whose writes may go to the spill thread; the fault VFS's stay on the stepping
    # thread, so a crash test's operation numbers name the same operations in every run (a test may add it)
    ASYNC_SHARE = 0.25  # of the limit: bytes handed to the spill thread and not written yet, at most; beyond it
    # enforce waits for the writes (the budget holds even when the spill thread falls behind)
    # whether reads of some keys first start reading their pages of spilled batches (:meth:`prefetch`): "auto" when
    # the process read at least PREFETCH_FROM pages from the disk during the last step (between the last two
    # enforces: the files outgrow the page cache, so a walk would wait for each), "on" always, "off" never
    PREFETCH = "auto"
    PREFETCH_FROM = 16
    # ... and at least PREFETCH_SHARE of the pages the last step's reads of some keys missed in the cache (so read
    # from the page cache or the disk): a warm step whose few pages came from the disk (the host's other work took
    # them back: 5 major faults in a 100M-row join step's ~4,500 misses) does not make the next step ask for all of
    # its pages; a spurious prefetch cost a 10M-row join step +1.7-2.0 ms of CPU (3.3-3.6 -> 5.3 ms; bench/history/RESULTS-2026-11-28-to-2026-12-02.md,
    # 2026-11-29, branch r31-flat100). 0: PREFETCH_FROM alone decides, as before
    PREFETCH_SHARE = 0.125
    # whether an eviction also drops the pages mapped around its pages' faults (invariant 12, ``_around``): the
    # files' Rss falls toward the cache's pages (a 10M-row join under 100 MiB: 175 -> 108 MiB, the cache 25 MiB) and
    # warm steps fault more (+22-49% a step there: bench/history/RESULTS-2026-11-28-to-2026-12-02.md, 2026-11-29); off, as before, until the budget's
    # RSS (Nexmark's peak) is weighed against the steps' time
    EVICT_AROUND = False
    # an eviction of a file's pages that makes this many runs or more drops the whole file's mapping instead, in one
    # madvise (invariant 12): the kernel's work per run (a TLB flush, ~1-2 us) dominated a warm spilled step, where a
    # whole clean mapping goes at ~0.1 us per mapped page and a read fault maps a page back at ~0.3 us; 0: never
    WHOLE_RUNS = 16
    # a cache over its cap evicts down to this share of it (the oldest reads first, as ever): evicting just what it is
    # over by made a full cache drop whole mappings at every enforce, and every step faulted its pages back
    EVICT_TO = 0.5
    # whether the mapped units of spilled files count in the budget (invariant 12, "mapped"): after each enforce the
    # batch files' units a read may have mapped, with the key indexes the cache holds, are at most what the budget
    # leaves beside the bytes in memory (:meth:`cache_cap`); False: only the cache's pages are (as before, when a
    # 10M-row join under 100 MiB kept 380 MiB of its files mapped between steps); tests switch it off to watch fail
    BOUND_MAPPED = True
    # within a step (invariant 12, "mapped"): with WALK_IN_PIECES a walk of a change over a spilled batch goes in
    # pieces of the change (key-hash order) that each map about PIECE_SHARE of the limit (at least a unit per column)
    # of the batch's file, the mapping dropped after each, so a step's reads map at most about a piece beyond what the
    # last enforce left. Off: the pieces cost a 1k-row step at 10M rows under 100 MiB +1.0-1.3 ms CPU (distinct,
    # join; 1.5-1.9x the step's CPU) at 0.25, +0.8-1.0 at 0.5, and 2-3x at 30M (bench/history/RESULTS-2026-11-28-to-2026-12-02.md, 2026-11-29, branch
    # r31-rss), for a peak within the step of ~40 MiB of the files mapped instead of 290-410 MiB (10M) and 770-1,460
    # MiB (30M): clean pages the kernel may take back
    WALK_IN_PIECES = False
    # ... but a walk of this many change rows or more goes in pieces whatever WALK_IN_PIECES says (None: never): a big
    # step's walk reads most units of the files it walks (a 1M-row join step at 10M rows under 100 MiB mapped ~300
    # MiB of them), and a piece's walk call and madvise are nothing beside it (bench/history/RESULTS-2026-11-28-to-2026-12-02.md, "A one-push load
    # under the budget")
    WALK_PIECES_FROM: int | None = 1 << 16
    PIECE_SHARE = 0.25
    PIECE_MIN: int | None = None  # bytes a piece may map at least (None: a unit per column; tests set it low)
    MAX_PIECES = 64
    # whether a drop of a spilled file's pages (an eviction, a whole-mapping drop, a merge's or a walk piece's) marks
    # the pages reads used as used in the page cache's LRU (invariant 12, "recency": the mapping is MADV_NORMAL for the
    # drop); False: as before, MADV_RANDOM throughout, and the kernel never learns which files a step reads
    RECENCY = True
    # whether a merge built on disk (``merge_dir``) builds its output in a scratch file with room for the batch file's
    # header and Arrow metadata before its rows, so that its spill (``spill_output``) writes those and the sections
    # after the rows and renames the file (batchfile.py invariant 7) instead of copying every row into a new file;
    # through the store's VFS, posix or fault (one that cannot adopt a file, ``_storage.vfs_adopts``: the copy).
    # False: the copy, as before
    IN_PLACE = True
    # a batch switched to the file this process wrote for it lets go of its Bloom filter's copy, read back from the
    # mapping (checked) at the first probe (invariant 16): a trace no read probes holds no filter in the budget
    LAZY_FILTERS = True
    # an enforce whose reads marked more units than the cap empties the cache instead of stamping their pages
    # (invariant 15, "overflow": :meth:`_overflows`); False: the per-page clock always (tests of the clock)
    OVERFLOW_EMPTIES = True
    # ... and keeps mapped, within :meth:`cache_cap`, the format-1 units reads used most over the last enforces
    # (invariant 15, "overflow": ``_keep_hot``), dropping only the others; False: every mapping a read marked is dropped
    # whole, as before (a 100M-row step then faults back all its ~1,000-1,700 units, bench/history/RESULTS-2026-11-28-to-2026-12-02.md r31-fault)
    OVERFLOW_KEEP = True

    def __init__(self, memory_limit: int, directory: str | None = None, durable: bool = False,
                 vfs: str = "posix") -> None:
        self.memory_limit = int(memory_limit)
        self.vfs = vfs
        self.durable = durable
        self._own_dir = directory is None
        self.directory = tempfile.mkdtemp(prefix="dbsp-spill-") if directory is None else os.fspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        self._lock = threading.RLock()
        self.stats: dict[str, int] = {"files_deleted": 0}
        self._reclaim: "deque[_Deleted]" = deque()  # deleted files not given back yet (:meth:`_reclaim_files`)
        if not durable:  # scratch: no checkpoint names an earlier process's files
            self.sweep(set())
        self._traces: "weakref.WeakSet[Trace]" = weakref.WeakSet()
        self._files: dict[int, BatchFile] = {}  # id(batch) -> its open file, while the batch lives
        self._grouped: dict[int, GroupedFile] = {}  # id(batch) -> its open format-2 file, while it lives (18)
        self._map_backoff: dict[int, int] = {}  # id(batch) -> the enforce its format-2 file maps again from (18)
        self._huge: set[int] = set()  # id(batch) of the files whose mapping is MADV_HUGEPAGE (invariant 12, "huge")
        self._offsets: dict[int, int] = {}  # id(batch) -> the file row its first row is (a restored slice), if not 0
        self._spans: dict = {}  # (id(batch), row hashes) -> its buffers' byte spans (spillread.pages_used's cache)
        self._owners: dict[str, int] = {}  # file name -> live batches read from it
        self._pinned: set[str] = set()  # files the last checkpoint (or one being written) names: kept (invariant 13)
        self._dead: set[str] = set()  # pinned files without a live batch: deleted once no checkpoint names them
        self._whole: set[int] = set()  # ids of traces read whole since the last enforce: every page is used
        self._used: list[tuple] = []  # (trace, batch, hashes or None: every page, rows or None) read since then
        # id(batch) -> per page of its file, the cache's clock when a read last used it, 0 when the cache does not
        # hold it (never used, or evicted since): 4 bytes per 4 KiB page (invariant 12)
        self._resident: dict[int, np.ndarray] = {}
        self._rounds: "deque[tuple[int, int, np.ndarray]]" = deque()  # (clock, id(batch), pages used then), oldest
        self._rounds_kept = 0  # rounds left by the last _compact_rounds: the next runs at twice as many
        self._cached = 0  # pages the cache holds
        # id(batch) -> per MAP_UNIT (2 MiB of address space) of its mapping, whether a read since the mapping was last
        # dropped may have mapped pages there, and the clock of its last read (invariant 12, "mapped")
        self._mapped: dict[int, np.ndarray] = {}
        self._mapped_at: dict[int, int] = {}
        self._mapped_bytes = 0  # bytes of the units marked, as of the last enforce (and key indexes held): mapped_bytes
        # id(batch) -> per MAP_UNIT of its format-1 file, how much the reads of the last overflowing enforces used it
        # (halved at each, +128 when read since the last): the units an overflow keeps mapped (invariant 15)
        self._heat: dict[int, np.ndarray] = {}
        self._walked_out: set[int] = set()  # ids of batches whose mapping a walk dropped after its last read (12)
        self._walk_state = threading.local()  # per thread, the files its walks keep mapped (walk_pieces)
        self._generation = 0  # enforce calls that trimmed the cache: the cache's clock
        self._touched: set[int] = set()  # ids of traces read in any way since then (their key index is used: 17)
        # id(key index) -> (its trace, pages it held, clock of its last use), the indexes the cache holds (17)
        self._index_used: "dict[int, tuple[weakref.ref[Trace], int, int]]" = {}
        self._unchecked: dict[int, BatchFile] = {}  # id(batch) -> its lazily opened file with bytes unchecked (14)
        self._cache: "weakref.WeakKeyDictionary[Trace, list[int]]" = weakref.WeakKeyDictionary()  # [hits, misses]
        self._next = 0
        self._writing: dict[str, Any] = {}  # file name -> weakref to the batch the spill thread writes to it (12)
        self._written: list[tuple] = []  # (batch weakref, name, path, size, error, opened file): writes finished
        self._jobs: "queue.Queue[tuple | None] | None" = None  # the spill thread's work, once it runs
        self._spiller: threading.Thread | None = None
        self._exiting = False  # the interpreter is exiting (at_exit.py): no spill thread is started again
        self._closed = False  # closed: no file is deleted any more (invariant 13)
        self._queued = 0  # bytes of the batches handed to the spill thread and not written yet
        self._in_memory = 0  # bytes in memory after the last enforce (batches, fences, filters, merge outputs)
        self._reserved = 0  # input bytes of merges started in memory since (merge_dir)
        self._reads_before = 0  # the process's pages read from the disk at the last enforce (_measure_reads)
        self._measure_reads()
        self._from_disk = self.PREFETCH_FROM  # those read during the last step: at first, the files count as cold
        self._step_misses = 0  # pages the reads accounted at the last enforce missed in the cache (PREFETCH_SHARE)
        self._grouped_pages = 0  # pages format-2 lookups read since the last enforce (invariant 18: all misses)
        self._token = os.urandom(6).hex()  # names never reused, even by a later process with the same pid
        # the C caches count in the budget's overhead: each at most its share while this store is open, or lower
        # (DBSP_REGION_CACHE_MB, DBSP_SCRATCH_MB, another store's smaller share: _SharedLimit)
        self._limits_held = True
        _REGION_LIMIT.hold(self._token, int(self.memory_limit * self.REGION_CACHE_SHARE))
        _SCRATCH_LIMIT.hold(self._token, int(self.memory_limit * self.SCRATCH_SHARE))
        # the format-2 decoder's read buffer (csrc/groupdecode.c, 32 MiB a thread at most): the same share, bounded
        # like the scratch cache's (invariant 18; a 1k-key lookup reads ~4 MiB, a larger read mallocs its own)
        _GROUPED_LIMIT.hold(self._token, int(self.memory_limit * self.SCRATCH_SHARE))
        weakref.finalize(self, _release_limits_later, self._token)  # a store never closed gives its shares back too
        self.stats.update({"files_written": 0, "compactions": 0, "bytes_written": 0, "evictions": 0, "bytes_evicted": 0,
                           "enforcements": 0, "cache_hits": 0, "cache_misses": 0, "pages_checked": 0, "overflows": 0,
                           "written_in_background": 0, "written_for_nothing": 0, "keys_sought": 0,
                           "merges_on_disk": 0, "pages_prefetched": 0, "prefetch_runs": 0,
                           "evict_calls": 0, "outputs_never_written": 0, "whole_evictions": 0,
                           "mapped_drops": 0, "mapped_bytes_dropped": 0, "walk_pieces": 0, "written_in_place": 0,
                           "bytes_in_place": 0, "merge_inputs_on_disk": 0,
                           "bytes_merged_out": 0, "bytes_compacted": 0, "compactions_abandoned": 0,
                           "grouped_map_backoffs": 0})

    def __enter__(self) -> "BatchStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- what traces call ----

    def count(self, stat: str, n: int) -> None:
        """Add ``n`` to ``stats[stat]`` under the store's lock: the merge thread writes files too (levels.py
        ``_Merge.seal``), and an increment is not atomic across threads."""
        with self._lock:
            self.stats[stat] = self.stats.get(stat, 0) + n

    def writing(self) -> bool:
        """Whether batches handed to the spill thread are not switched to their files yet (invariant 12)."""
        with self._lock:
            return bool(self._writing)

    def register(self, trace: "Trace") -> None:
        """``trace`` keeps its batches under this store's budget from now on."""
        with self._lock:
            self._traces.add(trace)

    def note_read(self, trace: "Trace", whole: bool = True) -> None:
        """``trace`` was read (``Trace._read``). A read that may touch any row (``whole``) uses every page of its
        spilled batches, counted once per step at the next :meth:`enforce`; a read of some keys (``whole`` False)
        reports the pages it reads itself, per batch (:meth:`note_pages`). Invariants 12 and 15."""
        with self._lock:
            self._touched.add(id(trace))
            if whole:
                self._whole.add(id(trace))

    def note_pages(self, trace: "Trace", b: "IndexedZSet", hashes: np.ndarray | None = None,
                   rows: np.ndarray | None = None) -> None:
        """A read of ``trace`` seeks key hashes ``hashes`` in batch ``b`` (those its filter may hold; None: reads
        any row of it) and reads the rows found (``rows``; None: the rows the fence places each hash among). When
        ``b`` is spilled, the pages that reads are used (invariant 12): recorded here, located, counted (invariant
        15) and added to the cache by the next :meth:`enforce` (:meth:`_trim_cache`)."""
        if id(b) not in self._files or (hashes is not None and len(hashes) == 0):
            return
        with self._lock:
            self._used.append((trace, b, hashes, rows))
            self._walked_out.discard(id(b))

    def walk_pieces(self, b: "IndexedZSet", rows: int, walk_rows: int | None = None) -> int:
        """In how many pieces a walk of ``rows`` change rows (key-hash order) over batch ``b`` goes (invariant 12,
        "mapped"), part of a walk of ``walk_rows`` change rows over every batch of a trace (``rows`` unless given;
        each batch's filter may leave fewer): 1 for a batch in memory, or without ``WALK_IN_PIECES`` for a walk of
        under ``WALK_PIECES_FROM`` (the whole walk's rows: a big step's walk over a tiered level's files is big, however
        few of its rows each file's filter leaves); for a spilled one, so that each piece maps at
        most about ``PIECE_SHARE`` of the limit (the rows' units: at most a unit per row and column, at most the file),
        at most ``MAX_PIECES``. The caller walks each piece in turn and calls :meth:`walked_out` after each when more
        than one. The bound holds across the walks of a thread between two enforces, not per file: a walk over
        several files of under a piece each (a tiered level's, levels.py invariant 15) walks each in one piece and
        keeps it mapped (:meth:`_walks`) until the files so kept and the next one would map more than a piece; then
        those are dropped first (:meth:`walked_out`, one piece of the walk)."""
        f = self._files.get(id(b))
        big = self.WALK_PIECES_FROM is not None and max(rows, walk_rows or 0) >= self.WALK_PIECES_FROM
        if f is None or not self.BOUND_MAPPED or not (self.WALK_IN_PIECES or big) or rows < 1:
            return 1
        cols = b.zset.data.num_columns + 3  # weights, key hashes, row hashes
        span = min(f.size, rows * cols * MAP_UNIT)
        floor = cols * MAP_UNIT if self.PIECE_MIN is None else self.PIECE_MIN
        piece = max(1, floor, int(self.memory_limit * self.PIECE_SHARE))
        kept = self._walks()
        if kept.held and kept.span + span > piece:  # with the files walked before, more than a piece: drop them first
            held, kept.held, kept.span = kept.held, [], 0
            for i in held:
                self._drop_walked(i)
            self.stats["walk_pieces"] += 1
        n = int(max(1, min(rows, -(-span // piece), self.MAX_PIECES)))
        if n == 1:  # walked in one piece, kept mapped until the walks after it come to more than a piece
            kept.held.append(id(b))
            kept.span += span
        return n

    def _walks(self) -> Any:
        """This thread's files walked in one piece since the last enforce and still mapped (``held``: ids of their
        batches, no reference: a batch merged away meanwhile takes its mapping along), and the units they may map
        (``span``): :meth:`walk_pieces`. An enforce counts them in the units mapped and bounds them (invariant 12,
        "mapped"), so a new enforce starts an empty list."""
        kept = self._walk_state
        gen = self.stats["enforcements"]
        if getattr(kept, "gen", None) != gen:
            kept.gen, kept.held, kept.span = gen, [], 0
        return kept

    def walked_out(self, b: "IndexedZSet") -> None:
        """After a piece of a walk over spilled batch ``b`` (:meth:`walk_pieces`): its mapping is dropped whole, and
        the units its reads marked since are not counted at the next enforce unless it is read again first."""
        if self._drop_walked(id(b)):
            self.stats["walk_pieces"] += 1

    def _drop_walked(self, i: int) -> bool:
        """:meth:`walked_out` of the spilled batch with id ``i``; False when there is none (merged away since; a
        batch spilled since under a reused id has its mapping dropped instead: a cost, never an error)."""
        f = self._files.get(i)
        if f is None:
            return False
        _drop_mapping(f.map)
        with self._lock:
            self._walked_out.add(i)
        return True

    def prefetch(self, b: "IndexedZSet", hashes: np.ndarray, row_hashes: bool = True) -> int:
        """Before a walk seeks key hashes ``hashes`` in batch ``b``: when ``b`` is spilled, start reading the pages
        the walk will read for those its filter may hold (``BatchFile.pages_read`` from the fence in memory: the
        key-hash pages of each seek and the rows the fence places each hash among, in every column; the values of a
        variable-width column, which its offsets locate, are left to the walk) but those the cache holds (mapped in
        already): one madvise(MADV_WILLNEED) per run of pages, in C without the GIL, each starting its run's reads
        and returning, so the reads of a step's pages overlap instead of waiting one fault at a time (invariant 12).
        ``row_hashes`` False: the walk reads no row hashes (a join's), so their pages are not asked for. Counts
        ``pages_prefetched`` and ``prefetch_runs``; returns the pages asked for."""
        f = self._files.get(id(b)) if len(hashes) and self.prefetching() else None
        if f is None or len(b) != f.rows or self._offsets.get(id(b)) or id(b) in self._huge:  # (a restored
            return 0  # slice seeks without the fence; a hot file's faults read 2 MiB folios: invariant 12)
        if id(b) in self._unchecked:  # a lazily opened file: its fence and filter are checked before use (14)
            before = int(f.checked.sum())
            f.check_sections()
            self.stats["pages_checked"] += int(f.checked.sum()) - before
        hashes = np.asarray(hashes, dtype=np.uint64)
        hashes = hashes[f.may_contain(hashes)]
        if len(hashes) == 0:
            return 0
        pages = f.pages_read(b, np.sort(hashes), values=False, row_hashes=row_hashes)
        if pages is None or len(pages) == 0:  # no fence (a small batch): its walk gallops from the start
            return 0
        clock = self._resident.get(id(b))
        if clock is not None:
            pages = pages[pages < len(clock)]
            pages = pages[clock[pages] == 0]
        runs = _advise(f.map, pages, mmap.MADV_WILLNEED)
        self.stats["pages_prefetched"] += len(pages)
        self.stats["prefetch_runs"] += runs
        return len(pages)

    def prefetching(self) -> bool:
        """Whether reads of some keys prefetch their pages now (``PREFETCH``; "auto": the last step read pages from
        the disk, as :meth:`enforce` measured, at least ``PREFETCH_FROM`` and ``PREFETCH_SHARE`` of the pages its
        reads missed in the cache: when the files sit in the page cache a prefetch costs a step a madvise per run
        of pages and saves nothing, and the first step that faults pages from the disk again turns it back on)."""
        return self.PREFETCH == "on" or (self.PREFETCH == "auto" and self._from_disk >= max(
            self.PREFETCH_FROM, int(self.PREFETCH_SHARE * self._step_misses)))

    def _measure_reads(self) -> None:
        """Pages the process read from the disk since the last call (major faults and blocks read: a prefetch's
        reads count as blocks, a walk's as faults), for :meth:`prefetching`. At each :meth:`enforce`."""
        ru = resource.getrusage(resource.RUSAGE_SELF)
        now = ru.ru_majflt + ru.ru_inblock * 512 // mmap.PAGESIZE
        self._from_disk, self._reads_before = now - self._reads_before, now

    def _pages_used(self, b: "IndexedZSet", f: BatchFile, hashes: np.ndarray | None, rows: np.ndarray | None
                    ) -> np.ndarray:
        """The pages of ``f`` a read of ``hashes`` (None: any row) in ``b`` reads (:meth:`note_pages`)."""
        pages = None
        if hashes is not None and len(b) == f.rows and not self._offsets.get(id(b)):  # (a restored slice of a
            hashes = np.sort(np.asarray(hashes, dtype=np.uint64))  # file seeks without the file's fence)
            pages = f.pages_read(b, hashes, rows)
        return np.arange(f.os_pages(), dtype=np.int64) if pages is None else pages

    def _count(self, trace: "Trace", hits: int, misses: int) -> None:
        c = self._cache.setdefault(trace, [0, 0])
        c[0] += hits
        c[1] += misses
        self.stats["cache_hits"] += hits
        self.stats["cache_misses"] += misses

    def merge_dir(self, batches: list["IndexedZSet"]) -> str | None:
        """Where the output of a merge of ``batches`` is built (invariant 12): None (in memory) when their bytes
        fit what the budget has left, else this store's directory (a scratch file there)."""
        need = sum(batch_bytes(x) for x in batches)
        with self._lock:
            room = int(self.memory_limit * self.BATCH_SHARE) - self._in_memory - self._reserved
            if need < self.FILE_MERGE_MIN or need <= room:
                self._reserved += need
                return None
        self.stats["merges_on_disk"] += 1
        self.stats["merge_inputs_on_disk"] += len(batches)
        return self.directory

    def on_disk(self, a: "IndexedZSet", b: "IndexedZSet") -> bool:
        """Whether a merge of ``a`` and ``b`` would be built on disk (:meth:`merge_dir`, reserving nothing: their bytes
        do not fit what the budget has left) or, from FILE_MERGE_MIN bytes on, reads a spilled input: their level is
        tiered (levels.py invariant 15). Smaller merges are built in memory whatever their inputs."""
        need = batch_bytes(a) + batch_bytes(b)
        if need < self.FILE_MERGE_MIN:
            return False
        if self.is_spilled(a) or self.is_spilled(b):
            return True
        room = int(self.memory_limit * self.BATCH_SHARE) - self._in_memory - self._reserved
        return need > room

    def merge_room(self, a: "IndexedZSet") -> int:
        """Bytes a merge built on disk (:meth:`merge_dir`) of batches like ``a`` reserves before its rows, so that
        its output becomes its batch file in place (invariant 12, ``IN_PLACE``); 0: the output is copied into one."""
        from dbsp_core import _storage

        if not self.IN_PLACE or not _storage.vfs_adopts(self.vfs):  # (posix and fault both do)
            return 0
        return in_place_room(a)

    def merge_pages_out(self, m: Any) -> None:
        """After a piece of merge ``m`` (levels.py ``_Merge.step``): the pages it wrote to a scratch output and read
        of spilled inputs leave the process (invariant 12)."""
        m.cursor.drop()
        m.dropped = m.cursor.consumed
        advice = getattr(mmap, "MADV_DONTNEED", None)
        for x in (e[1] for e in m.inputs):
            f = self._files.get(id(x))
            with self._lock:
                self._forget(id(x))  # its pages leave the cache too
            if f is not None and advice is not None:
                _drop_mapping(f.map)  # (closed: its batch is going)

    def spill_output(self, out: "IndexedZSet", cursor: Any) -> None:
        """Spill the output of a merge built in a scratch file (invariant 12), streaming its batch file from the
        scratch mapping and dropping the pages read after each piece. An output spilled already (a rolled-back step
        installs the same merge's output again: levels.py ``_Merge.result``) stays as it is."""
        if self.is_spilled(out):
            return
        if getattr(cursor, "scratch_path", None) is not None and not self._wants_grouped(out):  # in place (built
            # with room for the header); a format-2 file is written from the scratch mapping (invariant 18)
            name, path = self._new_name()
            size = write_in_place(path, out, cursor, sync=self.durable, vfs=self.vfs)
            if size is not None:
                self.count("written_in_place", 1)
                self.count("bytes_in_place", size)
                self.count("bytes_merged_out", size)
                self._switch(out, name, path, size)
                return
        self.count("bytes_merged_out", self._spill(out, drop=cursor.drop).size)

    def output_writer(self, out: "IndexedZSet", cursor: Any) -> InPlaceWrite | None:
        """:meth:`spill_output` in pieces (levels.py invariant 17, batchfile.py invariant 8): the writer that makes the
        finished merge output ``out`` its batch file in place, a piece per ``advance``, and then
        :meth:`output_written`; None when it cannot be made in place (or is spilled already): :meth:`spill_output`
        then writes it whole."""
        if self.is_spilled(out) or getattr(cursor, "scratch_path", None) is None or self._wants_grouped(out):
            return None
        _name, path = self._new_name()
        return InPlaceWrite.plan(path, out, cursor, sync=self.durable, vfs=self.vfs)

    def output_written(self, out: "IndexedZSet", w: InPlaceWrite) -> None:
        """``out``'s file written by :meth:`output_writer`'s ``w`` (done): switch ``out`` to it, opened with the fence
        and filter ``w`` holds (nothing of the file is read back but its header, footer and two Arrow pages)."""
        self.count("written_in_place", 1)
        self.count("bytes_in_place", w.size)
        self.count("bytes_merged_out", w.size)
        self._switch(out, os.path.basename(w.path), w.path, w.size, open_batch(w.path, sections=(w.fence, w.bloom)))

    def cache_counts(self, trace: "Trace") -> tuple[int, int]:
        """(hits, misses) of ``trace``'s reads of its spilled batches so far, in pages (invariant 15), as of the last
        :meth:`enforce`."""
        c = self._cache.get(trace)
        return (c[0], c[1]) if c is not None else (0, 0)

    # ---- checks of lazily opened files (invariant 14) ----

    def check(self, b: "IndexedZSet") -> None:
        """Check every unchecked byte of the file ``b`` is read from, before a read that may touch any row."""
        f = self._unchecked.get(id(b))
        if f is None:
            return
        self.stats["pages_checked"] += f.check_all()
        self._unchecked.pop(id(b), None)

    def check_seek(self, b: "IndexedZSet", hashes: np.ndarray) -> bool:
        """Check what seeking ``hashes`` in ``b`` reads; False when ``b`` was checked whole instead (a slice of a
        file, whose seeks do not go through the file's fence), so the caller need not check rows."""
        f = self._unchecked.get(id(b))
        if f is None:
            return False
        if len(b) != f.rows or self._offsets.get(id(b), 0):
            self.check(b)
            return False
        before = int(f.checked.sum())
        f.check_seek(b, hashes)
        self.stats["pages_checked"] += int(f.checked.sum()) - before
        return True

    def check_rows(self, b: "IndexedZSet", rows: np.ndarray) -> None:
        """Check the pages of rows ``rows`` of ``b`` (after :meth:`check_seek` found them)."""
        f = self._unchecked.get(id(b))
        if f is None:
            return
        before = int(f.checked.sum())
        f.check_rows(b, rows)
        self.stats["pages_checked"] += int(f.checked.sum()) - before
        if not f.unchecked():
            self._unchecked.pop(id(b), None)

    def is_spilled(self, b: "IndexedZSet") -> bool:
        return id(b) in self._files or id(b) in self._grouped

    def grouped_of(self, b: "IndexedZSet") -> GroupedFile | None:
        """The format-2 batch file ``b`` lives in (invariant 18), or None."""
        return self._grouped.get(id(b))

    def file_size(self, b: "IndexedZSet") -> int:
        """Bytes of the batch file ``b`` lives in, of either format (0: in memory)."""
        f = self._files.get(id(b)) or self._grouped.get(id(b))
        return 0 if f is None else int(f.size)

    def _in_memory_bytes(self, b: "IndexedZSet") -> int:
        """Bytes ``b``'s buffers hold in memory: none for a batch read from a format-1 file (its mapping counts as
        the cache's), the copy of its rows a whole read made for one read from a format-2 file (invariant 18)."""
        if id(b) in self._files:
            return 0
        if id(b) in self._grouped:
            return groupedbatch.copied_bytes(b)
        return batch_bytes(b)

    def _wants_grouped(self, b: "IndexedZSet") -> bool:
        """Whether ``b``'s file is written in format 2 (invariant 18: ``GROUPED_FROM``, its columns' types)."""
        return (self.GROUPED_FROM is not None and not groupedbatch.is_grouped(b) and batch_bytes(b) >= self.GROUPED_FROM
                and groupable_schema(b.schema))

    def file_of(self, b: "IndexedZSet") -> BatchFile | None:
        """The batch file ``b`` lives in, or None when it is in memory."""
        return self._files.get(id(b))

    def offset_of(self, b: "IndexedZSet") -> int:
        """The row of its file (:meth:`file_of`) that ``b``'s first row is (0 but for a restored slice)."""
        return self._offsets.get(id(b), 0)

    # ---- what checkpoints call (invariant 13) ----

    def path(self, name: str) -> str:
        """The path of batch file ``name`` (a file name in the store's directory, as checkpoints name files)."""
        if os.sep in name or name.startswith(".") or not name.endswith(BATCH_FILE_SUFFIX):
            raise ValueError(f"not a batch file name: {name!r}")
        return os.path.join(self.directory, name)

    def adopt(self, b: "IndexedZSet", f: BatchFile, offset: int = 0) -> None:
        """``b`` (restored from a checkpoint) is read in place from ``f``'s rows ``offset`` on: it counts as spilled
        and keeps ``f`` from deletion while it lives."""
        with self._lock:
            self._files[id(b)] = f
            if offset:
                self._offsets[id(b)] = offset
            name = os.path.basename(f.path)
            self._owners[name] = self._owners.get(name, 0) + 1
            if f.unchecked():  # opened lazily: checked as it is read (invariant 14)
                self._unchecked[id(b)] = f
        _drop_mapping(f.map)  # what opening read leaves the process (invariant 12, "mapped")
        weakref.finalize(b, self._release, id(b), name)

    def adopt_grouped(self, b: "IndexedZSet", f: GroupedFile) -> None:
        """Grouped batch ``b`` (restored from a checkpoint: groupedbatch.py ``reopened``) is read from the format-2 file
        ``f``: it counts as spilled and keeps ``f`` from deletion while it lives (invariants 13 and 18)."""
        name = os.path.basename(f.path)
        with self._lock:
            self._grouped[id(b)] = f
            self._owners[name] = self._owners.get(name, 0) + 1
        weakref.finalize(b, self._release, id(b), name)

    def pin(self, name: str) -> None:
        """A checkpoint being written names file ``name``: it is kept until one that does not has committed."""
        with self._lock:
            self._pinned.add(name)

    def checkpointed(self, names: set[str]) -> None:
        """A checkpoint naming exactly the files ``names`` committed (every worker's): files it does not name and
        no live batch reads are deleted, those of batches gone and those the checkpoint before named without a
        batch ever reading them (a table no operator reads: snapshot.py invariant 10); ``names`` stay pinned until
        the next one."""
        with self._lock:
            before, self._pinned = self._pinned, set(names)
            gone = [n for n in self._dead | before if n not in self._pinned and n not in self._owners]
            self._dead.difference_update(gone)
        for n in gone:
            self._delete(n)

    def sweep(self, names: set[str]) -> None:
        """Opening: delete every batch file (and temporary one) in the directory but ``names`` (those the opened
        checkpoint names) and those live batches read; ``names`` are pinned."""
        with self._lock:
            self._pinned = set(names)
            keep = self._pinned | set(getattr(self, "_owners", {}))  # (none yet when the constructor sweeps)
        for n in sorted(os.listdir(self.directory)):
            if ((n.endswith(BATCH_FILE_SUFFIX) and n not in keep) or n.endswith(BATCH_FILE_SUFFIX + ".tmp")
                    or (n.startswith(MERGE_SCRATCH_PREFIX) and n.endswith(".tmp"))):
                self._delete(n)

    def _delete(self, name: str) -> None:
        """Delete file ``name`` (through the VFS when durable); its blocks and page cache are given back later, a
        piece at a time (:meth:`_reclaim_files`), once no mapping of it is alive (batchfile.py invariant 9)."""
        from dbsp_core import _storage

        path = os.path.join(self.directory, name)
        fd, key = -1, None
        if self.RECLAIM_FILES > 0 and name.endswith(BATCH_FILE_SUFFIX):  # (not a temporary or a merge's scratch file,
            # which an open sweeps: a merge's scratch mapping is registered only once its file is made in place)
            try:  # a descriptor that keeps the inode once unlinked, to free it in pieces (invariant 12)
                fd = os.open(path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
                key = batchfile.file_key(os.fstat(fd))
            except OSError:
                if fd >= 0:
                    os.close(fd)
                fd = -1
        try:
            if self.durable:
                _storage.file_remove(path, self.vfs)
            else:
                os.unlink(path)
            self.stats["files_deleted"] = self.stats.get("files_deleted", 0) + 1
        except OSError:  # gone already, or the fault VFS crashed: the next open sweeps it
            if fd >= 0:
                os.close(fd)
            return
        if fd >= 0:
            try:  # another name still links the inode (a copy made with ``cp -al`` or os.link): its bytes are that
                linked = os.fstat(fd).st_nlink > 0  # name's, never truncated; the kernel frees it with its last link
            except OSError:
                linked = True
            if linked:
                os.close(fd)
                fd = -1
        if fd >= 0:  # unlinked (durably, through a VFS: its unlinks are once they return): no name reaches it now
            with self._lock:
                self._reclaim.append(_Deleted(fd, key, path))
                fd = -1
                if len(self._reclaim) > self.RECLAIM_FILES:  # the oldest not being truncated now (an enforce on
                    old = next((e for e in self._reclaim if not e.busy), None)  # another thread) is closed
                    if old is not None:
                        self._reclaim.remove(old)
                        fd = old.fd
            if fd >= 0:
                os.close(fd)

    # bytes of deleted files an enforce gives back at most (invariant 12): ~30 us a MiB on a quiet host, 60-150 under
    # load; 64 MiB cost the 10 steps after a 20M compaction's install 2-6 ms each (8-17 ms steps against main's 4-11),
    # 16 MiB 0.8-2.6 ms (5-11 ms), the 650 MB freed over ~45 steps (bench/history/RESULTS-2026-11-28-to-2026-12-02.md, r31-reclaim)
    RECLAIM_BYTES = 16 << 20
    # deleted files waiting for it at most (descriptors held; beyond: the oldest is closed at once, and the kernel frees
    # it when its last mapping goes). 0: off, a deleted file is unlinked and closed at once. A file is truncated only
    # once no mapping of it is alive: every mapping of a batch file is registered by the file's identity
    # (batchfile.py invariant 9, ``mapped``). (r31-slicewrite kept a weak reference to the batch's current mapping
    # only, and a live rescale under DBSP_MEMORY_LIMIT=1 died of SIGBUS reading another: so it was off on main.)
    RECLAIM_FILES = 256
    # invariant 12, "huge faults": a file whose reads of some keys in one enforce's window used pages in this share of
    # its 2 MiB units or more (and at least HUGE_MIN_UNITS of them) gets MADV_HUGEPAGE, so that its pages come back
    # in 2 MiB folios after any drop from the page cache (None: never)
    HUGE_SHARE: float | None = 0.25
    HUGE_MIN_UNITS = 16
    # and before a file's first truncation, the kernel's list of this process's mappings (/proc/self/maps: one read per
    # enforce that has a file to start, ~0.3-1 ms) is asked too: "kernel", a mapping the registry missed keeps the file
    # whole and counts ``reclaim_untracked``; "strict" raises instead (tests: a mapping not registered is a bug);
    # "off": the registry alone
    RECLAIM_CHECK = "kernel"

    def _reclaim_files(self, budget: int | None = None) -> int:
        """Give back the blocks and page cache of deleted files whose mappings are gone, ``budget`` bytes
        (``RECLAIM_BYTES``) at most, each file truncated from its end a piece at a time and closed when empty
        (invariant 12): the kernel frees a deleted file when its last descriptor or mapping goes, ~30 us per MiB
        of it, and a compaction's inputs (650 MB for 20M rows) die at once, in the step that installs it. Returns the
        bytes given back."""
        budget = self.RECLAIM_BYTES if budget is None else budget
        freed = 0
        with self._lock:
            todo = list(self._reclaim)
        kernel: tuple[set, set] | None = None
        for e in todo:
            if freed >= budget:
                break
            if batchfile.mapped(e.key):  # still mapped (a batch's buffers, a view, a restore's file): a later enforce
                continue
            if e.size < 0 and self.RECLAIM_CHECK != "off":  # its first piece (no mapping of it can be made now: no
                kernel = _mapped_deleted() if kernel is None else kernel  # name, a write-only descriptor)
                if (os.major(e.key[0]), os.minor(e.key[0]), e.key[1]) in kernel[0] or e.path in kernel[1]:
                    if self.RECLAIM_CHECK == "strict":
                        raise RuntimeError(f"reclaim of deleted batch file {e.path}: still mapped in this process, "
                                           "and no mapping of it is registered (batchfile.py invariant 9)")
                    if not e.untracked:
                        e.untracked = True
                        self.count("reclaim_untracked", 1)
                    continue
            with self._lock:
                if e not in self._reclaim:  # closed meanwhile (over RECLAIM_FILES)
                    continue
                e.busy = True  # its descriptor is not closed under us
            size = e.size
            try:
                if size < 0:
                    size = os.fstat(e.fd).st_size
                while size > 0 and freed < budget:
                    cut = min(size, budget - freed)
                    size -= cut
                    os.ftruncate(e.fd, size)
                    freed += cut
            except OSError:
                size = 0
            e.size = size
            with self._lock:
                e.busy = False
                if size == 0:
                    self._reclaim.remove(e)
            if size == 0:
                os.close(e.fd)
        return freed

    # ---- the budget ----

    def traces(self) -> list["Trace"]:
        with self._lock:
            return list(self._traces)

    def memory(self) -> tuple[int, int]:
        """(bytes of batches in memory, merge outputs written so far in memory included; bytes kept per spilled
        file: fences and filters) over every trace."""
        mem = 0
        for t in self.traces():
            for b in t._levels() + t.pending:
                mem += self._in_memory_bytes(b)
            mem += sum(merge_bytes(level.merge) for level in list(t._by_level) if level.merge is not None)
        return mem, sum(f.memory_bytes() for f in chain(list(self._files.values()), list(self._grouped.values())))

    def trace_bytes(self, trace: "Trace") -> dict[str, int]:
        """A trace's ``rows``, ``memory_bytes`` (batches in memory), ``disk_bytes`` (its share of the batch files
        its spilled batches read: a file's size over the rows read from it) and ``mapped_bytes`` (the pages of its
        spilled batches' files reads may have left mapped, as of the last enforce: :meth:`mapped_bytes`)."""
        out = {"rows": 0, "memory_bytes": 0, "disk_bytes": 0, "mapped_bytes": self.mapped_bytes(trace)}
        placed, pending = trace.parts()
        for b in list(placed) + list(pending):
            out["rows"] += len(b)
            f = self._files.get(id(b)) or self._grouped.get(id(b))
            if f is None:
                out["memory_bytes"] += batch_bytes(b)
            else:
                out["memory_bytes"] += groupedbatch.copied_bytes(b)
                out["disk_bytes"] += int(f.size * len(b) / max(1, f.rows))
        return out

    def disk_bytes(self) -> int:
        """Bytes of the batch files the store's batches live in."""
        return sum(f.size for f in chain(list(self._files.values()), list(self._grouped.values())))

    def enforce(self) -> int:
        """Spill loose batches, highest level and biggest first, then the pending ones of fresh traces (placed:
        :meth:`_fresh_pending`), until the batches in memory fit the budget's batch share; then trim the cache
        (invariant 12). Call between steps, never inside a restore. Returns the bytes spilled."""
        self.stats["enforcements"] += 1
        self._measure_reads()
        self._switch_written()
        candidates: list[tuple[int, int, Any]] = []
        mem = compacting = 0
        traces = self.traces()
        if self._grouped:
            self._release_copies(traces)
        with self._lock:
            writing = {id(b) for b in (r() for r in self._writing.values()) if b is not None}
        for t in traces:
            busy = {id(e[1]) for lvl in t._by_level if lvl.merge is not None for e in lvl.merge.inputs}
            for lvl, level in enumerate(t._by_level):
                for e in level.loose:
                    b = e[1]
                    if self.is_spilled(b):
                        mem += groupedbatch.copied_bytes(b)  # (a copy a whole read made, kept by a merge: 18)
                        continue
                    n = batch_bytes(b)
                    if id(b) in writing:  # on its way to a file (invariant 12): counted as gone
                        continue
                    mem += n
                    if id(b) not in busy and len(b):
                        candidates.append((lvl, n, b))
                if level.merge is not None:
                    pinned = sum(self._in_memory_bytes(e[1]) for e in level.merge.inputs)
                    if getattr(level.merge, "compaction", False):  # on their way to a file, as those the spill
                        compacting += pinned  # thread writes (levels.py invariant 16): counted as gone, up to a share
                        pinned = 0
                    mem += pinned + merge_bytes(level.merge)
            mem += sum(self._in_memory_bytes(b) for b in t.pending if id(b) not in writing)
        with self._lock:
            mem += max(0, compacting - max(0, int(self.memory_limit * self.ASYNC_SHARE) - self._queued))
        mem += sum(f.memory_bytes() for f in chain(list(self._files.values()), list(self._grouped.values())))
        budget = int(self.memory_limit * self.BATCH_SHARE)
        spilled = 0
        if mem > budget:
            candidates.sort(key=lambda c: (c[0], c[1]), reverse=True)
            over = mem - budget
            with (progress("spilling state to batch files", total=over >> 20, unit=" MiB")
                  if over >= self.PROGRESS_BYTES else nullcontext()) as shown:
                for _lvl, n, b in chain(candidates, self._fresh_pending(traces, writing)):
                    if mem <= budget:
                        break
                    if n >= self.ASYNC_BYTES and self.vfs in self.ASYNC_VFS and not self._exiting:
                        if self._queued + n > max(n, int(self.memory_limit * self.ASYNC_SHARE)):
                            self.settle()  # the spill thread fell behind: wait for it (back-pressure)
                        self._submit(b, n)
                        mem -= n
                    else:
                        f = self._spill(b)
                        mem -= n - f.memory_bytes()
                    spilled += n
                    if shown is not None:
                        shown.update(min(over, spilled) >> 20)
        with self._lock:
            self._in_memory, self._reserved = mem, 0
        self._trim_cache(traces)
        if self._reclaim:
            self.stats["bytes_reclaimed"] = self.stats.get("bytes_reclaimed", 0) + self._reclaim_files()
        return spilled

    def _fresh_pending(self, traces: list["Trace"], writing: set[int]) -> Iterator[tuple[int, int, Any]]:
        """What :meth:`enforce` spills once its loose batches are not enough (invariant 12): the pending batches of
        fresh traces (restored and not read since), placed as their first read would place them (levels.py
        invariant 5, ``Trace.end_fresh``: no merge, no change of content or order), biggest first. A generator:
        nothing is placed unless the budget is still exceeded when the loose batches are spent."""
        late = []
        for t in traces:
            pending = [b for b in t.pending if not self.is_spilled(b) and id(b) not in writing and len(b)]
            if pending and t.end_fresh():
                late += [(0, batch_bytes(b), b) for b in pending]
        late.sort(key=lambda c: (len(c[2]), c[1]), reverse=True)  # (a placed batch's level grows with its rows)
        yield from late

    def _new_name(self) -> tuple[str, str]:
        with self._lock:
            self._next += 1
            name = f"{self._token}-{self._next:012d}{BATCH_FILE_SUFFIX}"
        return name, os.path.join(self.directory, name)

    def _spill(self, b: "IndexedZSet", drop: Any = None) -> BatchFile:
        """Write ``b`` to a new batch file and switch it, in place, to the file's mapped buffers (invariant 12);
        ``drop`` returns the pages of a scratch mapping the write has read (a merge built on disk). A batch
        :meth:`_wants_grouped` is written in format 2 and switched to a grouped batch instead (invariant 18)."""
        name, path = self._new_name()
        if self._wants_grouped(b):
            size = write_grouped(path, b, self.vfs, sync=self.durable, drop=drop)
            if size is not None:
                return self._switch_grouped(b, name, path, size)
        size = write_batch(path, b, self.vfs, sync=self.durable, drop=drop)
        return self._switch(b, name, path, size)

    def _submit(self, b: "IndexedZSet", n: int) -> None:
        """Hand ``b`` to the spill thread (started on first use) to be written to a new batch file (invariant 12)."""
        self._start_thread()
        name, path = self._new_name()
        ref = weakref.ref(b)
        with self._lock:
            self._writing[name] = ref
            self._queued += n
        assert self._jobs is not None
        self._jobs.put((ref, name, path, n))  # not the batch: one merged away while queued is not written

    def _start_thread(self) -> None:
        if self._spiller is None:
            self._jobs = queue.Queue()
            t = threading.Thread(target=self._spill_loop, args=(self._jobs,), name="dbsp-spill-thread", daemon=True)
            t.start()  # started before it is published: close() joins what it finds
            self._spiller = t
            stop_at_exit(self)  # a pipeline never closed: stopped before Python finalizes (at_exit.py)

    def _spill_loop(self, jobs: "queue.Queue[tuple | None]") -> None:
        """The spill thread: write each batch handed over; the next :meth:`enforce` switches it (invariant 12)."""
        while True:
            job = jobs.get()
            try:
                if job is None:
                    return
                ref, name, path, n = job
                b = ref()
                size, error, f = 0, None, None
                try:
                    if b is not None:
                        size = (write_grouped(path, b, self.vfs, sync=self.durable) if self._wants_grouped(b)
                                else None)  # (None: format 1, invariant 18)
                        if size is None:
                            size = write_batch(path, b, self.vfs, sync=self.durable)
                            f = open_batch(path)  # here too: its fence and filter are checked and copied (O(rows / 6))
                        else:
                            f = open_grouped(path)
                except BaseException as exc:  # raised by the next enforce, on the stepping thread
                    error = exc
                with self._lock:
                    self._written.append((ref, name, path, size, error, f))
                    self._queued -= n
                del f
                del b, job
            finally:
                jobs.task_done()

    def _switch_written(self) -> None:
        """Switch each batch the spill thread has written to its file; delete the file of one merged away meanwhile;
        raise the first write error (invariant 12). Between steps only."""
        with self._lock:
            done, self._written = self._written, []
            for job in done:
                self._writing.pop(job[1], None)
        error = None
        for ref, name, path, size, exc, f in done:
            b = ref()
            if exc is not None or b is None:  # failed, or merged away while queued or written: the file goes
                if exc is None and f is not None:
                    self.stats["written_for_nothing"] += 1
                error = error or exc
                self._delete(name)
                try:
                    os.unlink(path + ".tmp")
                except OSError:
                    pass
                continue
            self._switch(b, name, path, size, f)
            self.stats["written_in_background"] += 1
        if error is not None:
            raise error

    def settle(self) -> None:
        """Wait until the spill thread has written every batch handed to it, and switch them (between steps)."""
        if self._jobs is not None:
            self._jobs.join()
        self._switch_written()

    def _switch(self, b: "IndexedZSet", name: str, path: str, size: int, f: BatchFile | None = None) -> BatchFile:
        """Switch ``b``, in place, to the mapped buffers of the batch file just written for it (invariant 12), opened
        here unless the spill thread opened it (``f``): then the switch costs no read of the file."""
        if isinstance(f, GroupedFile):
            return self._switch_grouped(b, name, path, size, f)
        if f is None:
            f = open_batch(path)
        new = f.batch
        new._z._distinct = b._z._distinct  # the same rows: what the old ZSet knew of them still holds
        b._z, b._kh, b._rh, b._fx, b._cv = new._z, new._kh, new._rh, new._fx, None
        f = f._replace(batch=None)  # the file must not keep its batch alive: the batch's death deletes the file
        if self.LAZY_FILTERS:  # (invariant 16: held again at the first probe)
            f.release_filter()
        _drop_mapping(f.map)  # what opening read (header, footer, sections) leaves the process: no read counted it
        with self._lock:
            self._files[id(b)] = f
            self._owners[name] = self._owners.get(name, 0) + 1
            self.stats["files_written"] += 1
            self.stats["bytes_written"] += size
        weakref.finalize(b, self._release, id(b), name)
        return f

    def _switch_grouped(self, b: "IndexedZSet", name: str, path: str, size: int, f: GroupedFile | None = None
                        ) -> GroupedFile:
        """Switch ``b``, in place, to a grouped batch read from the format-2 file just written for it (invariant 18),
        opened here unless the spill thread opened it (``f``)."""
        if f is None:
            f = open_grouped(path)
        groupedbatch.become_grouped(b, f, batch_bytes(b))
        with self._lock:
            self._grouped[id(b)] = f
            self._owners[name] = self._owners.get(name, 0) + 1
            self.stats["files_written"] += 1
            self.stats["bytes_written"] += size
            self.stats["grouped_files_written"] = self.stats.get("grouped_files_written", 0) + 1
        weakref.finalize(b, self._release, id(b), name)
        return f

    def adopt_merged(self, name: str, path: str, size: int, key: tuple, nbytes: int) -> "IndexedZSet":
        """The output of a streamed merge (groupedmerge.py invariant S3), written to the format-2 file ``path``
        (named by :meth:`_new_name`): opened, a grouped batch of its rows (none read), counted as spilled, kept from
        deletion while it lives (invariant 18)."""
        f = open_grouped(path)
        b = groupedbatch.reopened(f, key, nbytes)
        with self._lock:
            self._grouped[id(b)] = f
            self._owners[name] = self._owners.get(name, 0) + 1
            self.stats["files_written"] += 1
            self.stats["bytes_written"] += size
            self.stats["bytes_merged_out"] += size
            self.stats["grouped_files_written"] = self.stats.get("grouped_files_written", 0) + 1
            self.stats["streamed_merges"] = self.stats.get("streamed_merges", 0) + 1
        weakref.finalize(b, self._release, id(b), name)
        return b

    def _release_copies(self, traces: list["Trace"]) -> None:
        """Empty the copies whole reads made of grouped batches' rows (invariant 18; groupedbatch.py B3), but those
        of a merge's inputs (the merge reads them until it ends)."""
        for t in traces:
            busy = {id(e[1]) for lvl in t._by_level if lvl.merge is not None for e in lvl.merge.inputs}
            for b in t._levels(sync=False) + t.pending:
                if id(b) not in busy and groupedbatch.copied_bytes(b):
                    groupedbatch.release_rows(b)

    def gather(self, b: "IndexedZSet", hashes: np.ndarray) -> "IndexedZSet | None":
        """The rows of grouped batch ``b`` whose key hash is in ``hashes`` (invariant 18; groupedbatch.py B2), its
        groups' pages asked for first (WILLNEED a run of groups) while :meth:`prefetching` says reads find the disk."""
        advise = len(hashes) > 1 and self.prefetching()
        self.count("keys_sought", len(hashes))
        self.count("grouped_lookups", 1)
        if advise:
            self.count("grouped_prefetched", 1)
        got = groupedbatch.gather(b, hashes, advise)
        f = groupedbatch.source_file(b)
        with self._lock:
            self._grouped_pages += max(0, f.last_groups_read) * f.group_pages
        return got

    def _release(self, key: int, name: str) -> None:
        """A batch read from file ``name`` is gone (merged away, dropped): once no live batch reads the file, it is
        deleted, or when a checkpoint names it, kept until one that does not has committed (invariant 13)."""
        with self._lock:
            f = self._files.pop(key, None)
            self._grouped.pop(key, None)
            self._huge.discard(key)
            self._offsets.pop(key, None)
            self._spans.pop((key, True), None)
            self._spans.pop((key, False), None)
            self._forget(key)
            self._unchecked.pop(key, None)
            left = self._owners.get(name, 1) - 1
            if left > 0:
                self._owners[name] = left
                return
            self._owners.pop(name, None)
            if name in self._pinned:
                self._dead.add(name)
                return
            if self._closed:  # (invariant 13: the next open sweeps it)
                return
        self._delete(name)  # (truncated once no mapping of it is alive: batchfile.py invariant 9)

    def _trim_cache(self, traces: list["Trace"]) -> None:
        """The cache's accounting of the reads since the last call (:meth:`note_pages`; a trace read whole: every
        page of its spilled batches): locate the pages each read, count hits and misses (invariant 15), stamp them
        with the cache's clock, and evict the least recently used pages beyond ``memory_limit * CACHE_SHARE`` bytes
        (invariant 12): a few numpy operations per batch read, over arrays of the pages read."""
        with self._lock:
            whole, self._whole = self._whole, set()
            used, self._used = self._used, []
            out, self._walked_out = self._walked_out, set()  # dropped after their last read: no unit mapped
            touched, self._touched = self._touched, set()
            for t in traces:
                if id(t) in whole:
                    used.extend((t, b, None, None) for b in t._levels() if id(b) in self._files)
            grouped_pages, self._grouped_pages = self._grouped_pages, 0
        self._step_misses = grouped_pages  # (a format-2 lookup's pages: no clock, all misses, invariant 18)
        indexes = [(t, ix) for t in traces if id(t) in touched
                   for ix in (t.held_index,) if ix is not None and ix.nbytes >= self.INDEX_FILE_MIN]
        gmarks = self._grouped_units()
        if not used and not indexes and not gmarks and self._cached == 0 and self._mapped_bytes == 0:
            return
        located = []
        seeks = []  # the reads of some keys: their pages located in one C call (spillread.pages_used)
        for t, b, hashes, rows in used:
            f = self._files.get(id(b))
            if f is None:
                continue
            if hashes is not None and len(b) == f.rows and not self._offsets.get(id(b)):  # (a restored slice of a
                seeks.append((len(located), b, f, hashes, rows))  # file seeks without the file's fence)
                located.append([t, id(b), f, None, True])
            else:
                located.append((t, id(b), f, np.arange(f.os_pages(), dtype=np.int64), hashes is not None))
        if seeks:
            pages = spillread.pages_used([(b, f, h, r) for _, b, f, h, r in seeks], self._spans)
            for (i, _, f, _, _), p in zip(seeks, pages):
                located[i][3] = np.arange(f.os_pages(), dtype=np.int64) if p is None else p
        del used, seeks
        if self.HUGE_SHARE is not None and located:
            self._hot_files(located)
        if self.OVERFLOW_EMPTIES and (located or gmarks) and not indexes and self._overflows(located, gmarks, out):
            return
        with self._lock:  # batches may die (and leave the cache) on other threads meanwhile
            self._generation += 1
            now = self._generation
            for t, key, f, pages, sought in located:
                if key not in self._files:
                    continue
                clock = self._resident.get(key)
                if clock is None:
                    clock = self._resident[key] = np.zeros(f.os_pages(), dtype=np.int32)
                new = spillread.stamp(clock, pages, now)  # (clock[pages] = now: the misses were at 0)
                self._count(t, len(pages) - new, new)
                self._cached += new
                if sought:  # (a read of every page, a merge's say, is no measure of a step's lookups)
                    self._step_misses += new
                self._rounds.append((now, key, pages))
                marks = self._mapped.get(key)
                if marks is None:
                    marks = self._mapped[key] = np.zeros(_units(f.base, f.size), dtype=bool)
                if key not in out:
                    marks[_unit_of(f.base, pages)] = True
                    self._mapped_at[key] = now
            for key, u in gmarks.items():  # a format-2 file's mapped reads: the units they flagged (invariant 18)
                marks = self._mapped.get(key)
                if marks is None or len(marks) != len(u):
                    marks = self._mapped[key] = np.zeros(len(u), dtype=bool)
                marks |= u
                self._mapped_at[key] = now
            for t, ix in indexes:  # invariant 17: an index used counts whole (its probes' pages are not known)
                n = -(-int(ix.nbytes) // mmap.PAGESIZE)
                held = self._index_used.get(id(ix))
                self._cached += n - (held[1] if held is not None else 0)
                self._index_used[id(ix)] = (weakref.ref(t), n, now)
                self._rounds.append((now, id(ix), None))
            self._forget_indexes()
            if len(self._rounds) > max(64, 2 * self._rounds_kept):
                self._compact_rounds()
            cap = self.cache_cap() // mmap.PAGESIZE  # over it: evict down to EVICT_TO of it, so that the whole
            evict, drop = self._evict_oldest(cap if self._cached <= cap else int(cap * self.EVICT_TO))  # drops space out
            evict.extend(self._bound_mapped(cap * mmap.PAGESIZE))
        for ix in drop:  # between steps: no step probes or grows the index meanwhile (invariant 17)
            ix.drop_pages()
        # the runs of pages evicted, in C with the GIL released, up to 1024 runs a system call (process_madvise:
        # 4,300 runs a 10M join step took 13 ms as a madvise each); handing them to the spill thread cost the step
        # more (waking it hands it the GIL) than the calls
        self.stats["evict_calls"] += (spillread.evict(evict, self.RECENCY and hasattr(mmap, "MADV_NORMAL"))
                                      if spillread.NATIVE else _evict(evict))

    def _grouped_units(self) -> dict[int, np.ndarray]:
        """The ``MAP_UNIT``s each format-2 file's mapped lookups read since the last call (invariant 18; flagged by the
        C reads, taken and cleared here), by batch key: the files that read none left out."""
        with self._lock:
            files = list(self._grouped.items())
            now = self.stats["enforcements"]
            for key, until in list(self._map_backoff.items()):  # backed off long enough: mapped reads again
                if now >= until:
                    del self._map_backoff[key]
                    f = self._grouped.get(key)
                    if f is not None:
                        f.read_mapped = groupedfile.READ_MAPPED
        out = {}
        for key, f in files:
            u = f.take_units()
            if u is not None:
                out[key] = u
        return out

    def _mapping_to_drop(self, key: int) -> Any:
        """The mapping of batch ``key``'s file (format 1's, or a format-2 file's once a lookup mapped it) that the
        caller is about to drop for the mapped bound, or None. Not a plain getter: a format-2 file whose reads found
        few groups a unit backs off here, its lookups reading by pread for the next ``MAP_BACKOFF`` enforces
        (invariant 18). Under the lock."""
        f = self._files.get(key)
        if f is None:
            f = self._grouped.get(key)
            if f is not None and self.MAP_BACKOFF and f.map is not None and \
                    f.last_groups < self.MAP_GROUPS_PER_UNIT * max(1, f.last_units):
                f.read_mapped = False
                self._map_backoff[key] = self.stats["enforcements"] + self.MAP_BACKOFF
                self.count("grouped_map_backoffs", 1)  # (an RLock: this runs under it)
        return getattr(f, "map", None) if f is not None else None

    def _hot_files(self, located: list) -> None:
        """Invariant 12, "huge faults": a file whose reads of some keys since the last enforce (``located``, as
        :meth:`_overflows` takes it) used pages in at least ``HUGE_SHARE`` of its ``MAP_UNIT``s (and ``HUGE_MIN_UNITS``)
        gets MADV_HUGEPAGE on its mapping, once: from then on a fault on a page the page cache does not hold reads the
        aligned 2 MiB around it as one folio, and :meth:`prefetch` leaves the file alone (a WILLNEED reads 4 KiB
        folios). Counts ``huge_files``."""
        units: dict[int, tuple[Any, list[np.ndarray]]] = {}
        for _t, key, f, pages, sought in located:
            if sought and key not in self._huge and f.map is not None:
                units.setdefault(key, (f, []))[1].append(_unit_of(f.base, pages[pages < f.os_pages()]))
        for key, (f, us) in units.items():
            n = len(np.unique(np.concatenate(us))) if len(us) > 1 else len(np.unique(us[0]))
            if n >= self.HUGE_MIN_UNITS and n >= self.HUGE_SHARE * _units(f.base, f.size):
                try:
                    f.map.madvise(mmap.MADV_HUGEPAGE)
                except (OSError, ValueError):  # (a kernel without it, or the file closed meanwhile: faults as before)
                    continue
                with self._lock:
                    if key in self._files:
                        self._huge.add(key)
                self.stats["huge_files"] = self.stats.get("huge_files", 0) + 1

    def _overflows(self, located: list, gmarks: dict[int, np.ndarray] | None = None,
                   out: set[int] | None = None) -> bool:
        """Invariant 15, "overflow": when the ``MAP_UNIT``s the reads since the last enforce marked (``located``: per
        read its trace, batch key, file, pages and whether it sought keys) come to more than :meth:`cache_cap`, the
        mapped bound would drop every mapping they read (and every older one) whatever the clock says, so the page
        bookkeeping is skipped: every page read counts a miss, the cache is emptied (clocks, rounds: it holds no page
        past this enforce), and the mappings are dropped: with ``OVERFLOW_KEEP`` all but the hot units of format-1
        files (:meth:`_keep_hot`, at most :meth:`cache_cap` of them, still marked mapped), else every mapping a read
        marked, whole. ``out``: the batches whose mapping a walk dropped after its last read (nothing of theirs is
        mapped to keep). Returns False (nothing done) otherwise, or while the cache counts a key index (its pages are
        evicted in the clock's order)."""
        marks: dict[int, np.ndarray] = {}
        used: dict[int, np.ndarray] = {}  # format-1 key -> pages the reads used per unit (the keep's tie-break)
        for _t, key, f, pages, _sought in located:
            u = marks.get(key)
            if u is None:
                u = marks[key] = np.zeros(_units(f.base, f.size), dtype=bool)
            units = _unit_of(f.base, pages[pages < f.os_pages()])
            u[units] = True
            if self.OVERFLOW_KEEP and (out is None or key not in out):
                n = np.bincount(units, minlength=len(u))[:len(u)]
                used[key] = n if key not in used else used[key] + n
        for key, u in (gmarks or {}).items():
            marks[key] = u
        cap = self.cache_cap()
        if sum(int(np.count_nonzero(u)) for u in marks.values()) * MAP_UNIT <= cap:
            return False
        evict: list[Any] = []
        parts: list[tuple[Any, int, np.ndarray]] = []
        with self._lock:
            if self._index_used:
                return False
            self._generation += 1
            misses = 0
            for t, key, f, pages, sought in located:
                if key not in self._files:
                    continue
                self._count(t, 0, len(pages))
                if sought:
                    misses += len(pages)
            self._step_misses += misses
            keep = self._keep_hot(marks, used, cap, out or set()) if self.OVERFLOW_KEEP else {}
            dropped = set(marks) | {k for k, m in self._mapped.items() if m.any()}
            for key in dropped:
                if key in keep:  # its cold units go, by runs; its hot ones stay mapped
                    f = self._files[key]
                    kept, gone = keep[key]
                    parts.append((f.map, f.base, gone))
                    was = marks.get(key)
                    held = self._mapped.get(key)
                    if held is not None and (was is None or len(held) == len(was)):
                        was = held if was is None else was | held
                    n = int(np.count_nonzero(was[gone])) if was is not None and len(was) == len(kept) else 0
                    if n:  # (a mapping dropped in part counts as a drop, with the units it dropped)
                        self.stats["mapped_drops"] += 1
                        self.stats["mapped_bytes_dropped"] += n * MAP_UNIT
                    continue
                m = self._mapping_to_drop(key)
                if m is not None:
                    evict.append((m, None))
                    self.stats["mapped_drops"] += 1
                    held = self._mapped.get(key)
                    self.stats["mapped_bytes_dropped"] += int(np.count_nonzero(
                        marks[key] if key in marks else held)) * MAP_UNIT
            self.stats["overflows"] += 1
            self._resident.clear()
            self._rounds.clear()
            self._rounds_kept = 0
            self._mapped.clear()
            self._mapped_at.clear()
            self._cached = 0
            self._mapped_bytes = 0
            for key, (kept, _gone) in keep.items():
                self._mapped[key] = kept
                self._mapped_at[key] = self._generation
                self._mapped_bytes += int(np.count_nonzero(kept)) * MAP_UNIT
            self.stats["overflow_kept_units"] = self.stats.get("overflow_kept_units", 0) + \
                self._mapped_bytes // MAP_UNIT
        recency = self.RECENCY and hasattr(mmap, "MADV_NORMAL")
        self.stats["evict_calls"] += (spillread.evict(evict, recency) if spillread.NATIVE else _evict(evict))
        self.stats["evict_calls"] += _drop_units(parts)
        return True

    def _keep_hot(self, marks: dict[int, np.ndarray], used: dict[int, np.ndarray],
                  cap: int, out: set[int]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Invariant 15, "overflow", with ``OVERFLOW_KEEP``: of the format-1 files' units mapped now (read since the
        last enforce, ``marks``, or kept by the last one), the hottest stay mapped, at most ``cap`` bytes of them:
        each unit's heat (``_heat``) is halved and gets 128 when read since the last enforce, so a unit every step
        reads is kept before one read now and then, ties going to the unit whose reads used more pages (``used``).
        Returns per such file (its mapping 2 MiB aligned or not) the units kept (a bool per unit: its new marks) and
        the units to drop (sorted: all the others, so that a page no read counted, one a fault mapped around a counted
        one or a read outside the store's accounting, leaves as with a whole drop); the other files (format 2, a
        mapping gone, one a walk dropped after its last read: ``out``) are not in it. Under the lock."""
        cand: list[tuple[int, np.ndarray, np.ndarray]] = []  # (key, units mapped now, their score)
        for key in set(used) | {k for k, m in self._mapped.items() if m.any()}:
            f = self._files.get(key)
            if f is None or f.map is None or key in out:
                continue
            n = _units(f.base, f.size)
            now = np.zeros(n, dtype=bool)
            if key in used:
                now |= marks[key]
            held = self._mapped.get(key)
            if held is not None and len(held) == n:
                now |= held
            heat = self._heat.get(key)
            if heat is None or len(heat) != n:
                heat = self._heat[key] = np.zeros(n, dtype=np.uint8)
            heat >>= 1
            if key in used:
                heat[marks[key]] += 128
            idx = np.flatnonzero(now)
            pages = np.minimum(used[key][idx], 127) if key in used else np.zeros(len(idx), dtype=np.int64)
            cand.append((key, idx, heat[idx].astype(np.int64) * 128 + pages))
        room = max(0, cap // MAP_UNIT)
        total = sum(len(idx) for _k, idx, _s in cand)
        if total > room:  # the score the room-th best unit has: keep those above it, and of those at it enough
            scores = np.concatenate([s for _k, _i, s in cand])
            bar = np.partition(scores, total - room)[total - room] if room else np.iinfo(np.int64).max
            left = room - int(np.count_nonzero(scores > bar))
        res: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for key, idx, score in cand:
            if total > room:
                take = score > bar
                at = np.flatnonzero(score == bar)[:max(0, left)]
                take[at] = True
                left -= len(at)
            else:
                take = np.ones(len(idx), dtype=bool)
            kept = np.zeros(_units(self._files[key].base, self._files[key].size), dtype=bool)
            kept[idx[take]] = True
            res[key] = (kept, np.flatnonzero(~kept))  # every other unit (a page no read counted there goes too)
        return res

    def _evict_oldest(self, cap: int) -> tuple[list[tuple[mmap.mmap, np.ndarray]], list[Any]]:
        """Drop from the cache the pages of the oldest reads not used since, a read at a time, until it holds at most
        ``cap`` pages; returns them per file, for :func:`_evict`, and the key indexes whose pages go (invariant 17,
        each whole). Under the lock."""
        evict: list[tuple[mmap.mmap, np.ndarray]] = []
        drop: list[Any] = []
        while self._cached > cap and self._rounds:
            when, key, pages = self._rounds.popleft()
            if pages is None:  # a key index's use
                held = self._index_used.get(key)
                if held is None or held[2] != when:
                    continue  # used again since (or evicted)
                del self._index_used[key]
                self._cached -= held[1]
                t = held[0]()
                ix = t.held_index if t is not None else None
                if ix is not None and id(ix) == key:
                    drop.append(ix)
                    self.stats["evictions"] += 1
                    self.stats["bytes_evicted"] += held[1] * mmap.PAGESIZE
                continue
            clock = self._resident.get(key)
            f = self._files.get(key)
            if clock is None or f is None:
                continue
            pages = pages[pages < len(clock)]
            gone = pages[clock[pages] == when]  # not used since
            over = self._cached - cap
            if len(gone) > over:  # the last read evicted: only what the cache is over by, its other pages stay
                self._rounds.appendleft((when, key, gone[over:]))
                gone = gone[:over]
            if len(gone):
                clock[gone] = 0
                self._cached -= len(gone)
                if self.WHOLE_RUNS and _runs(gone) >= self.WHOLE_RUNS:  # the whole mapping, in one madvise: the
                    evict.append((f.map, None))  # pages the cache holds stay counted (a read faults them back)
                    self.stats["whole_evictions"] += 1
                    self._unmap(key)
                else:
                    evict.append((f.map, _around(f.base, clock, gone) if self.EVICT_AROUND else gone))
                self.stats["evictions"] += 1
                self.stats["bytes_evicted"] += len(gone) * mmap.PAGESIZE
        return evict, drop

    def _bound_mapped(self, cap: int) -> list[Any]:
        """Invariant 12, "mapped": while the units of spilled files that reads may have mapped (``MAP_UNIT`` each,
        marked by :meth:`_trim_cache`) and the key indexes the cache holds come to more than ``cap`` bytes, drop the
        mapping of the file read longest ago (the biggest first among those read at the same enforce), whole, in one
        madvise; returns them for :func:`_evict`. The pages the cache holds stay counted (a read faults them back
        from the page cache: invariant 15's hits and misses are the clock's either way). Sets ``_mapped_bytes``.
        Under the lock."""
        index = sum(n for _ref, n, _when in self._index_used.values()) * mmap.PAGESIZE
        held = {key: int(np.count_nonzero(m)) * MAP_UNIT for key, m in self._mapped.items()}
        total = sum(held.values())
        out: list[Any] = []
        if self.BOUND_MAPPED and total + index > cap:
            for key in sorted(held, key=lambda k: (self._mapped_at.get(k, 0), -held[k])):
                if total + index <= cap:
                    break
                m = self._mapping_to_drop(key)
                if m is None or not held[key]:
                    continue
                out.append((m, None))
                self._unmap(key)
                total -= held[key]
                self.stats["mapped_drops"] += 1
                self.stats["mapped_bytes_dropped"] += held[key]
        self._mapped_bytes = total + index
        return out

    def _unmap(self, key: int) -> None:
        """Batch ``key``'s mapping is dropped whole: none of its units holds a page a read mapped. Under the lock."""
        marks = self._mapped.get(key)
        if marks is not None:
            marks[:] = False

    def mapped_bytes(self, trace: "Trace | None" = None) -> int:
        """Bytes of spilled files' pages that reads may have left mapped in the process, as of the last
        :meth:`enforce` (invariant 12, "mapped": ``MAP_UNIT`` per unit a read marked since its mapping was last
        dropped; at most :meth:`cache_cap` less the key indexes the cache holds, which the total includes); of
        ``trace``'s batches only (no index) when given."""
        if trace is None:
            return self._mapped_bytes
        with self._lock:
            keys = [id(b) for b in trace._levels()]
            return sum(int(np.count_nonzero(self._mapped[k])) * MAP_UNIT for k in keys if k in self._mapped)

    def _forget_indexes(self) -> None:
        """The key indexes whose trace is gone or holds another one leave the cache (invariant 17): their pages went
        with them. Under the lock."""
        for key, (ref, n, _when) in list(self._index_used.items()):
            t = ref()
            ix = t.held_index if t is not None else None
            if ix is None or id(ix) != key:
                del self._index_used[key]
                self._cached -= n

    def _compact_rounds(self) -> None:
        """Drop from the queue of rounds the pages used again since (stamped with a later round) or gone, and the
        rounds left with none: evicting is what shortens the queue, and a cache under its share never evicts, so
        without this it kept one round per batch read per enforce for ever. After it the queue holds at most a
        round per page the cache holds (and per index it counts); called once it has doubled, so its cost is a
        few numpy operations per round added. Under the lock."""
        kept: "deque[tuple[int, int, np.ndarray]]" = deque()
        for when, key, pages in self._rounds:
            if pages is None:  # a key index's use: kept while it is the index's last
                held = self._index_used.get(key)
                if held is not None and held[2] == when:
                    kept.append((when, key, pages))
                continue
            clock = self._resident.get(key)
            if clock is None or key not in self._files:
                continue
            pages = pages[pages < len(clock)]
            pages = pages[clock[pages] == when]
            if len(pages):
                kept.append((when, key, pages))
        self._rounds = kept
        self._rounds_kept = len(kept)

    def _forget(self, key: int) -> None:
        """Batch ``key``'s pages leave the cache (the batch is gone, or a merge dropped them). Under the lock."""
        clock = self._resident.pop(key, None)
        if clock is not None:
            self._cached -= int(np.count_nonzero(clock))
        self._mapped.pop(key, None)
        self._mapped_at.pop(key, None)
        self._heat.pop(key, None)
        self._map_backoff.pop(key, None)

    def cache_cap(self) -> int:
        """Bytes the cache may hold after an :meth:`enforce` (invariant 12): what the budget has left beside the bytes
        in memory at that enforce (batches, merge outputs, fences and filters), and at least ``memory_limit *
        CACHE_SHARE``. A state whose batches are all spilled gives the cache nearly all of the budget: the batch
        share is a ceiling for batches, not a reservation the cache may not use."""
        return max(int(self.memory_limit * self.CACHE_SHARE), self.memory_limit - self._in_memory)

    def cached_pages(self) -> int:
        """Pages of spilled files the cache holds (used since their last eviction; at most :meth:`cache_cap` bytes of
        them after an :meth:`enforce`)."""
        with self._lock:
            return self._cached

    def _stop_spill_thread(self) -> None:
        if self._spiller is not None:  # its unswitched files are scratch: an open sweeps what no checkpoint names
            assert self._jobs is not None
            self._jobs.put(None)
            self._spiller.join()
            self._spiller = None

    def _stop_for_exit(self) -> None:
        """Interpreter exit with the store open (at_exit.py): stop the spill thread; later spills write in place."""
        self._exiting = True
        self._stop_spill_thread()

    def close(self) -> None:
        """Forget the traces; a temporary directory is removed (mappings in use stay readable until released)."""
        self._stop_spill_thread()
        with self._lock:
            fds, self._reclaim = [e.fd for e in self._reclaim], deque()
        for fd in fds:  # (the kernel frees what is left of them now)
            os.close(fd)
        with self._lock:
            self._closed = True
            self._traces = weakref.WeakSet()
            held, self._limits_held = self._limits_held, False
        if held:
            _release_limits(self._token)
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)


class _Deleted:
    """A deleted batch file whose blocks and page cache are not given back yet (``BatchStore._reclaim_files``): its
    descriptor (write-only), identity (batchfile.py ``file_key``), bytes left (-1: not looked at yet), path, whether
    the kernel showed a mapping the registry did not know (counted once), and whether a reclaim truncates it now."""

    __slots__ = ("fd", "key", "size", "path", "untracked", "busy")

    def __init__(self, fd: int, key: tuple[int, int], path: str) -> None:
        self.fd, self.key, self.size, self.path = fd, key, -1, path
        self.untracked = self.busy = False

    def __repr__(self) -> str:
        return f"_Deleted({self.path!r}, fd={self.fd}, size={self.size})"


def _mapped_deleted() -> tuple[set[tuple[int, int, int]], set[str]]:
    """The (major, minor, inode) and paths of the deleted files mapped in this process, from /proc/self/maps (empty
    where there is none: the registry alone then decides, batchfile.py invariant 9)."""
    ids: set[tuple[int, int, int]] = set()
    paths: set[str] = set()
    try:
        with open("/proc/self/maps", "rb") as fh:
            text = fh.read()
    except OSError:
        return ids, paths
    for line in text.split(b"\n"):
        if not line.endswith(b" (deleted)"):
            continue
        parts = line.split(None, 5)
        if len(parts) < 6:
            continue
        major, _, minor = parts[3].partition(b":")
        try:
            ids.add((int(major, 16), int(minor, 16), int(parts[4])))
        except ValueError:
            pass
        paths.add(os.fsdecode(parts[5][:-len(b" (deleted)")]))
    return ids, paths


def _advise(m: mmap.mmap, pages: np.ndarray, advice: int) -> int:
    """madvise(``advice``) the pages ``pages`` (sorted, unique page numbers) of mapping ``m``, one call per run of
    adjacent pages, in C without the GIL; returns the runs (0 when the mapping is closed: its batch is gone)."""
    from dbsp_core import _storage

    if len(pages) == 0:
        return 0
    cut = np.flatnonzero(np.diff(pages) != 1) + 1
    first = np.ascontiguousarray(pages[np.concatenate(([0], cut))], dtype=np.int64)
    last = np.ascontiguousarray(pages[np.append(cut - 1, len(pages) - 1)], dtype=np.int64)
    try:
        _storage.advise_pages(m, first, last - first + 1, mmap.PAGESIZE, advice)
    except (OSError, ValueError):
        return 0
    return len(first)


FAULT_AROUND = max(1, 65536 // mmap.PAGESIZE)  # pages a read fault may map (Linux's fault_around_bytes: 64 KiB)


def _around(base: int, clock: np.ndarray, pages: np.ndarray) -> np.ndarray:
    """``pages`` (sorted page numbers of a mapping at address ``base``) and the pages a read fault on them may have
    mapped besides (the kernel maps the page-cache pages of the aligned ``FAULT_AROUND`` pages of address space around
    the page faulted), less those the cache holds (``clock`` not 0): what an eviction of ``pages`` drops, so that the
    pages no read counted leave with those it did (invariant 12). Sorted, unique."""
    shift = (base // mmap.PAGESIZE) % FAULT_AROUND  # the mapping's first page's place in its window
    w = (pages + shift) // FAULT_AROUND
    w = w[np.concatenate(([True], w[1:] != w[:-1]))]
    out = (w[:, None] * FAULT_AROUND + (np.arange(FAULT_AROUND) - shift)).ravel()
    out = out[(out >= 0) & (out < len(clock))]
    return out[clock[out] == 0]


def _drop_mapping(m: mmap.mmap) -> None:
    """Every page of mapping ``m`` leaves the process (madvise(MADV_DONTNEED): they stay in the page cache), the pages
    reads used since the last drop marked used in the page cache's LRU on the way out (:func:`_recency`)."""
    try:
        with _recency(m):
            m.madvise(mmap.MADV_DONTNEED)
    except (OSError, ValueError):  # closed: its batch is gone
        pass


@contextmanager
def _recency(m: mmap.mmap) -> Iterator[None]:
    """Around a drop of pages of batch-file mapping ``m`` (invariant 12, "recency"): the mapping is MADV_NORMAL for the
    drop and MADV_RANDOM again after it, so that the kernel's unmapping marks the page-cache folio of every page a read
    used (its accessed bit set) as used (Linux ``zap_present_ptes``: ``folio_mark_accessed`` only for a mapping with
    recency, which MADV_RANDOM takes away; reclaim's reference scan skips such a mapping too). Without it the engine's
    reads never reached the page cache's LRU: a file read every step aged as one never read, and under memory pressure
    the kernel reclaimed the hot files first (bench/history/RESULTS-2026-11-28-to-2026-12-02.md, 2026-11-29, branch r31-fault100). Faults stay under
    MADV_RANDOM (no read-around). ``BatchStore.RECENCY`` False: the drop as before."""
    on = BatchStore.RECENCY and hasattr(mmap, "MADV_NORMAL")
    if on:
        try:
            m.madvise(mmap.MADV_NORMAL)
        except (OSError, ValueError):
            on = False
    try:
        yield
    finally:
        if on:
            try:
                m.madvise(mmap.MADV_RANDOM)
            except (OSError, ValueError):  # closed meanwhile: its batch is gone
                pass


def _drop_units(parts: list[tuple[mmap.mmap, int, np.ndarray]]) -> int:
    """Drop from the process the pages of these ``MAP_UNIT``s (per entry a file's mapping, its address and sorted unit
    numbers, :func:`_unit_of`'s), a madvise(MADV_DONTNEED) per run of adjacent units, up to 1024 runs a system call,
    each mapping's runs within its :func:`_recency`; returns the system calls made."""
    from dbsp_core import _storage

    before = _storage.advise_calls()
    per = MAP_UNIT // mmap.PAGESIZE
    for m, base, units in parts:
        if len(units) == 0:
            continue
        cut = np.flatnonzero(np.diff(units) != 1) + 1
        lo = units[np.concatenate(([0], cut))]
        hi = units[np.append(cut - 1, len(units) - 1)] + 1
        shift = (base % MAP_UNIT) // mmap.PAGESIZE  # unit 0 holds the mapping's first page, this far into it
        first = np.maximum(lo * per - shift, 0)
        count = hi * per - shift - first
        try:
            with _recency(m):
                _storage.advise_pages(m, np.ascontiguousarray(first, dtype=np.int64),
                                      np.ascontiguousarray(count, dtype=np.int64), mmap.PAGESIZE, mmap.MADV_DONTNEED)
        except (OSError, ValueError):  # closed: its batch is gone
            pass
    return _storage.advise_calls() - before


def _evict(evict: list[tuple[mmap.mmap, np.ndarray]]) -> int:
    """Drop these pages (sorted page numbers, per file mapping) from the process, a madvise(MADV_DONTNEED) per run of
    adjacent pages, up to 1024 runs a system call (they stay in the page cache; a read faults them back); returns the
    system calls made."""
    from dbsp_core import _storage

    before = _storage.advise_calls()
    whole = {id(m): m for m, pages in evict if pages is None}  # each mapping once (several reads of it evicted)
    for m in whole.values():
        _drop_mapping(m)
    runs: dict[int, list] = {}
    for m, pages in evict:
        if pages is not None and id(m) not in whole:
            runs.setdefault(id(m), [m]).append(pages)
    for m, *parts in runs.values():  # the recency once per mapping (two madvise calls), around its runs
        try:
            with _recency(m):
                for pages in parts:
                    _advise(m, pages, mmap.MADV_DONTNEED)
        except (OSError, ValueError):
            pass
    return _storage.advise_calls() - before + len(whole)


MAP_UNIT = 2 << 20  # bytes of address space one read fault may map at most (a PMD: invariant 12, "mapped")


def _units(base: int, size: int) -> int:
    """``MAP_UNIT``s of address space a mapping of ``size`` bytes at address ``base`` spans."""
    return (base % MAP_UNIT + size + MAP_UNIT - 1) // MAP_UNIT if size else 0


def _unit_of(base: int, pages: np.ndarray) -> np.ndarray:
    """The ``MAP_UNIT`` (numbered from the one holding the mapping's first byte) that each of ``pages`` (page numbers
    of a mapping at address ``base``) lies in: what a read fault on the page may map, at most (a fault maps its page,
    the page-cache pages of its fault-around window or its whole folio, within one page table: one PMD)."""
    first = (base % MAP_UNIT) // mmap.PAGESIZE
    return (pages + first) // (MAP_UNIT // mmap.PAGESIZE)


def _runs(pages: np.ndarray) -> int:
    """Runs of adjacent pages in ``pages`` (sorted, unique page numbers)."""
    return int(np.count_nonzero(np.diff(pages) != 1)) + 1 if len(pages) else 0


class spilling(ThreadValue):
    """Traces read or inserted into on this thread, inside the block, keep their batches under the given store's
    budget (invariant 12); None: in memory."""

    __slots__ = ()
    tls = threading.local()
    attr = "store"


def current_batch_store() -> "BatchStore | None":
    """The BatchStore in force on this thread (:func:`spilling`), or None."""
    return spilling.current()
