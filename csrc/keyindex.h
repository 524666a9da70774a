/* keyindex.h: a hash index from a key of fixed-width and byte columns to int64 sums, kept beside a trace so that a step
 * finds a key's accumulated weight or sums with one probe instead of one galloping walk per trace batch.
 *
 * Invariants (enforced here; dbsp_keyindex_check verifies 1-3, 5 and 8):
 *  1. An entry holds a key of nkeys columns (at most DBSP_KEYINDEX_MAX_KEYS), each a fixed-width type or a byte
 *     type (string, binary, large or not: invariant 8), as one 64-bit word per column: for a fixed-width one its
 *     canonical value: integers sign- or zero-extended (bool 0/1, date32 and timestamps as
 *     integers), floats as their canonical bits (-0.0 as 0.0, every NaN alike: column.h invariant 2), a null as
 *     the word 0 with its bit set in the entry's null mask. The column types are fixed when the index is made;
 *     batches read or added must have the same types at the key positions (DBSP_ETYPE otherwise), so two rows
 *     have one entry exactly when their keys are equal by row identity. No hash decides equality: the hash given
 *     with each row (the row's key hash, hash.h) only places the entry.
 *  2. An entry holds nvals int64 sums, and never all of them zero: an update that brings every sum of an entry
 *     to zero removes it, so an absent key reads as all zeros, which is what the sums of no rows are.
 *  3. Open addressing with linear probing over a power-of-two table of slot words, at most 3/4 full; a removal
 *     shifts the slots after the hole back (no tombstones), so every probe ends at the first empty slot. A slot is
 *     one word: the low 28 bits of the key hash, which place it (no table has more than 2^28 slots), the key's null
 *     mask in bits 28-35, and 1 + the number of its entry in bits 36-63 (0 is an empty slot). An entry is nkeys +
 *     nvals words, the key words then the sums, in an array of entries apart from the table: a key costs its
 *     entry plus one slot word (8 B at a table 3/8 to 3/4 full), where a slot holding the key and sums inline
 *     cost a whole entry and a head word per slot, empty ones included (count and sum: three sums, 40 B per slot,
 *     53-107 B per key; now 32 B + 11-21 B). A probe compares the slot's 36 tag bits, then the entry's key words;
 *     it reads a slot word and then an entry: a get prefetches 16 probes' slots at once, then the entries of their
 *     home slots (a key is mostly at home), so their misses overlap. Entries never move within the array: growing
 *     and removals move slot words; a removed entry goes on a free list that new keys take first. The array grows
 *     by a quarter while small, by a sixteenth by mremap once large (no copy inside a step), up to what the table can point to, in whole 2 MiB
 *     pages kept 2 MiB-aligned (transparent huge pages: a probe into 4 KiB pages misses the TLB); a shrink (below)
 *     copies the live entries into an array of their own size.
 *  4. Every product weight * value and every sum is checked: one outside int64 returns DBSP_EOVERFLOW and leaves
 *     the index broken (dbsp_keyindex_broken): the caller must drop it, its sums are then partly updated. A put or
 *     an add that fails for memory or a size limit (DBSP_ENOMEM, DBSP_ETOOBIG) does so before writing anything of
 *     the failing key (a growth that fails changes nothing; an entry taken for it is given back), so the index is
 *     whole, holding the keys stored before it: a caller that knows what those were can undo them, clear the
 *     mark (dbsp_keyindex_unbreak) and count the refusal (dbsp_keyindex_note_refusal; csrc/linrun.h invariant 4).
 *  5. Growing never rehashes the whole index in one call: a new entry that would pass 3/4 starts a table of twice
 *     the slots, and the old one is moved into it a few slots per row added, a whole cluster (run of full slots)
 *     at a time, from a slot that was empty. Until it ends, a key whose home in the old table is moved sits in the
 *     new table; a key whose old home is not moved yet sits in the old one (whole probe runs move together), where
 *     new keys of such homes go too, up to an eighth of its slots (so it stays at most 7/8 full and the move ends
 *     before the new table is 3/4 full): the new table's pages are then first written by the move, in order,
 *     instead of by new keys at random (every first write of a page faults and zeroes it). A new key that finds
 *     no room there, or whose probe run reaches the moved part, spills into the new table; while any has, a
 *     probe of an unmoved home looks in both tables. Moved old slots are empty. A step that adds a few keys to a
 *     large index so pays a few slot moves and page faults per key instead of a pause of O(index) (measured:
 *     0.3 s at 1.6M keys). A bulk call (rows at least a quarter of the new table's slots, such as a load) moves
 *     everything at once: that work is a part of its own. Shrinking (an index emptied to 1/16) still rehashes at
 *     once.
 *  6. A process-wide budget bounds the bytes of every index's slot tables and entry arrays together
 *     (dbsp_keyindex_set_budget; 0: none): a growth of either that would pass it fails like one past the index's
 *     own max_bytes (DBSP_ETOOBIG, the index broken), so its owner drops that index and the others keep theirs.
 *     A growth is counted beside every byte held at that moment, the growing index's old table included, with one
 *     atomic add (indexes on several threads grow at once); a new index's first table (64 slots) is counted, never
 *     refused.
 *  7. Under a memory budget (dbsp_core/trace/spill.py) the index can live in files instead of anonymous memory
 *     (dbsp_keyindex_set_dir): from then on its large regions (a slot table or the entries from 2 MiB) are shared
 *     mappings of unlinked files in that directory (O_TMPFILE; gone with the index, or with the process), and
 *     dbsp_keyindex_drop_pages returns their pages to the page cache (madvise: the written ones stay the file's,
 *     which the kernel writes back), so the index holds no memory of the process until a probe faults a page
 *     back. Lookups, sums and growth are the same; a file that cannot be made or grown fails as memory does
 *     (DBSP_ENOMEM).
 *  8. A byte column's word in an entry is 1 + the word offset of a record in the index's arena (0 for a null): a
 *     length word, then the value's bytes, zero-padded to a whole word. A probe that meets a slot of its tag
 *     compares such a column by length and bytes (memcmp), so keys whose hashes (all 64 bits, or the 28 a tag
 *     keeps) collide stay apart: equality is row identity, as for fixed-width keys (column.h invariant 2: bytes
 *     equal byte for byte). The arena grows like the entries (malloc'ed while small, mremap'ed whole pages once
 *     large, a file under invariant 7, counted in max_bytes and the budget of invariant 6, in nbytes); a removed
 *     key's records become garbage, and an arena that needs room while at least half of it is garbage is
 *     compacted instead of grown (every live record copied into a fresh arena in slot order: O(slots + live
 *     bytes) once per as many words freed, O(1) amortized; a shrink, invariant 5's rehash, compacts too). Entries
 *     never move for it: only their record words change. The index is a cache (dbsp_core/trace/keyindex.py),
 *     never written to disk, so records have no format of their own. A test hook (dbsp_keyindex_test_hash_bits)
 *     keeps fewer hash bits in every tag, so that distinct keys share tags and only the comparison of words and
 *     bytes tells them apart.
 */
#ifndef DBSP_KEYINDEX_H
#define DBSP_KEYINDEX_H

#include <stdint.h>
#include "column.h"

#define DBSP_KEYINDEX_MAX_KEYS 8
#define DBSP_KEYINDEX_MAX_VALS 64

typedef struct DbspKeyIndex DbspKeyIndex;

/* A new empty index for keys of the given column types (fixed width or bytes) and nvals sums per key, whose slot
 * table and entries together never grow past max_bytes (0: no limit; while the table grows, the old one, half its
 * size, is held beside it, not counted). Errors: DBSP_ETYPE (another type), DBSP_EINVAL (counts out of
 * range), DBSP_ENOMEM. */
int dbsp_keyindex_new(const int32_t *types, int32_t nkeys, int32_t nvals, int64_t max_bytes, DbspKeyIndex **out);
void dbsp_keyindex_free(DbspKeyIndex *ix);

/* Invariant 8's test hook: keep only the low `bits` bits of each key hash in tags (1-27; 0 or 28 and more: all 28)
 * from now on, in every index of the process. Tests only, before any index is made: an index made under one
 * setting must not be read or changed under another. */
void dbsp_keyindex_test_hash_bits(int32_t bits);

/* Invariant 6: set the process-wide budget on the slot tables of all indexes (bytes; 0 or less: none), read it, and
 * read the bytes held now. Tables held when a lower budget is set stay; only later growth is refused. */
void dbsp_keyindex_set_budget(int64_t bytes);
int64_t dbsp_keyindex_budget(void);
int64_t dbsp_keyindex_total_bytes(void);

/* Entries held, bytes of the slot tables (both while growing) and of the entries, whether it is broken (invariant 4)
 * or growing (invariant 5). */
int64_t dbsp_keyindex_len(const DbspKeyIndex *ix);
int64_t dbsp_keyindex_bytes(const DbspKeyIndex *ix);
int dbsp_keyindex_broken(const DbspKeyIndex *ix);
/* Invariant 4: clear the broken mark of an index whose failed store its caller undid, count such a refusal, and read
 * the count (the owner tells "refused, the index as it was" from "broken" by it). */
void dbsp_keyindex_unbreak(DbspKeyIndex *ix);
void dbsp_keyindex_note_refusal(DbspKeyIndex *ix);
int64_t dbsp_keyindex_refusals(const DbspKeyIndex *ix);
int dbsp_keyindex_growing(const DbspKeyIndex *ix);
/* New keys that spilled into the new table while growing (invariant 5), ever: for tests. */
int64_t dbsp_keyindex_spills(const DbspKeyIndex *ix);

/* For i < n: acc[i * nvals + v] += sum v of the entry of the key of row r = (sel ? sel[i] : i) of b, whose key
 * columns are keys[0..nkeys) and whose key hash is kh[i]. Errors: DBSP_ETYPE, DBSP_EINVAL. */
int dbsp_keyindex_get(const DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, const int64_t *sel,
                      const uint64_t *kh, int64_t n, int64_t *acc);

/* dbsp_keyindex_get that also sets slots[i] to where the sums of probed key i live (NULL when absent), for
 * dbsp_keyindex_set_slot. Such a pointer stays valid until the index next changes shape: an entry added (the
 * entries may move) or removed (any dbsp_keyindex_add or dbsp_keyindex_put). */
int dbsp_keyindex_get_slots(DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, const int64_t *sel,
                            const uint64_t *kh, int64_t n, int64_t *acc, int64_t **slots);
/* dbsp_keyindex_get_slots into sums that need not be zeroed: sums[i * nvals + j] is set to the sums of probed key i
 * (0 when absent), copied, not added (a step's old totals: csrc/linrun.c). */
int dbsp_keyindex_read_slots(DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, const int64_t *sel,
                             const uint64_t *kh, int64_t n, int64_t *sums, int64_t **slots);
/* Overwrite the sums at a slot from dbsp_keyindex_get_slots with vals[v * vstride] (not all zero: invariant 2). */
void dbsp_keyindex_set_slot(DbspKeyIndex *ix, int64_t *slot, const int64_t *vals, int64_t vstride);

/* For every row i < b->nrows, with weight w (b->weights, +1 when NULL) times sign (+1 or -1): sum v of the entry
 * of row i's key (columns keys[0..nkeys), key hash kh[i]) += w * b[cols[v]][i] for cols[v] >= 0 (an integer
 * column other than uint64, a date or a timestamp, as int64; a null value counts 0), += w for cols[v] == -1, and
 * += w if b[c][i] is not null for cols[v] == -2 - c (the weighted count of a column's values, which tells a sum
 * of 0 from a null). Entries are created and removed as invariant 2 says.
 * Errors: DBSP_ETYPE, DBSP_EINVAL, DBSP_EOVERFLOW (invariant 4: the index is then broken), DBSP_ENOMEM,
 * DBSP_ETOOBIG (the table or the entries would pass max_bytes or the budget, or the table 2^28 slots): after these two
 * the rows added before the failing one are taken back, newest first (no growth needed, freed entries reused), and
 * the index is whole and as before the call (dbsp_keyindex_refusals counts it); only a key of a string column put
 * back may find no arena room, and the index then stays broken. */
int dbsp_keyindex_add(DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, const uint64_t *kh,
                      const int32_t *cols, int64_t sign);

/* dbsp_keyindex_add that also sets before[i * nvals + v] to the sums of row i's key just before row i is added
 * (so, for rows with distinct keys, the sums before the call): a reader of old sums that then adds the same rows
 * (distinct) probes once per row. A failure is as dbsp_keyindex_add's (before[] then holds nothing of use). */
int dbsp_keyindex_add_before(DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, const uint64_t *kh,
                             const int32_t *cols, int64_t sign, int64_t *before);

/* Take back a dbsp_keyindex_add (or add_before) of the same rows and sign that succeeded, after any number of other
 * changes that were themselves taken back or are still held: a rollback's undo (dbsp_core/trace/keyindex.py
 * invariant 19). Every product and sum wraps (mod 2^64), so the result is exact whenever the state it returns to is
 * one the index held, though a row's own product, or a sum halfway through, lies outside int64 (a key's row of old
 * totals, -1 times INT64_MIN, and its row of new ones, each of which an add of the rows one at a time overflows on,
 * while the step that stored them put their net). The rows the add subtracted (weight times sign below 0) are put
 * back before those it added are taken off, so a key the add changed keeps its entry throughout (a key the add made
 * is removed at the end, as invariant 2 says). A key the add removed is made again: for an index that grew no
 * further since the add, in an entry the removal freed, within its table; a string key's records may still find no
 * arena room (DBSP_ENOMEM, the index then broken, as after a failed add). No shrink. Errors: as dbsp_keyindex_add's
 * argument checks (DBSP_ETYPE, DBSP_EINVAL, a broken index), DBSP_ENOMEM or DBSP_ETOOBIG (broken). */
int dbsp_keyindex_take_back(DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, const uint64_t *kh,
                            const int32_t *cols, int64_t sign);

/* Set the sums of the key of row r of b (key columns keys, key hash h) to vals[v * vstride] for v < nvals, or
 * remove the key when vals is NULL or all zero (invariant 2): what a caller that computed a key's new sums itself
 * (the linear aggregate, csrc/fold.h) stores instead of adding its rows. `more`: the keys the caller's whole call
 * puts, this one included: as for dbsp_keyindex_add's rows, a call of at least a quarter of the slots of the table
 * it grows to finishes that growth at once, so that a load's growth is not left to the small steps after it.
 * Errors as dbsp_keyindex_add's (no overflow: nothing is summed). */
int dbsp_keyindex_put(DbspKeyIndex *ix, const DbspBatch *b, const int32_t *keys, int64_t r, uint64_t h,
                      const int64_t *vals, int64_t vstride, int64_t more);

/* Invariant 7: make large regions files in `dir` from now on, moving the large anonymous ones there now (a copy);
 * NULL: anonymous regions from now on. Errors: DBSP_ENOMEM (no memory, or the files cannot be made). */
int dbsp_keyindex_set_dir(DbspKeyIndex *ix, const char *dir);
/* Invariant 7: drop the pages of the file regions from the process; returns their bytes (0: none are files). Not
 * while another thread uses the index. */
int64_t dbsp_keyindex_drop_pages(DbspKeyIndex *ix);
/* The mapped regions (the large ones, anonymous or files: at most 4, their starts into at and bytes into len);
 * returns how many. For tests and measurements (the process's resident pages of each, /proc/self/smaps). */
int dbsp_keyindex_regions(const DbspKeyIndex *ix, void **at, size_t *len);

/* DBSP_OK when invariants 1-3, 5 and 8 hold (each key findable from its slot's hash, in one table only, each entry
 * pointed to by one slot or on the free list, no all-zero entry, load bound, the moved part of an old table
 * empty, each non-null byte value a record inside the arena, the live records' words counted), else
 * DBSP_EINVAL. */
int dbsp_keyindex_check(const DbspKeyIndex *ix);

#endif
