"""Checks a PyTorch-format memory snapshot the way PyTorch's viewers read it.

Usage: check_torch_snapshot.py SNAPSHOT.pickle EXPECTED.json

Loads the file with Python's own `pickle` (a reader the allocator did not write) and checks
every rule of MEMORY_VIZ.md: the keys and their order, blocks tiling their segments, the
segment totals, `_memory_viz.py stats`' identity (free external + free internal + allocated
== reserved), the totals against the allocator's `memory_stats` (EXPECTED.json), and the
history: replayed backwards from the segments as MemoryViz.js does (every block inside a
segment at every step, every undone free finding its block), then forwards from the state
that replay reaches (every free matches a live allocation at that address, every alloc lands
on free memory). Prints one line per check group; exits non-zero with the reason otherwise.
"""
import json
import pickle
import sys

snap_path, expected_path = sys.argv[1], sys.argv[2]
with open(snap_path, "rb") as f:
    snap = pickle.load(f)
with open(expected_path) as f:
    expected = json.load(f)


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


check(isinstance(snap, dict), "top level is a dict")
check(list(snap) == ["segments", "device_traces", "allocator_settings", "external_annotations"],
      f"top-level keys {list(snap)}")
traces = snap["device_traces"]
check(isinstance(traces, list) and len(traces) == expected["device"] + 1,
      f"device_traces has one list per device index: {len(traces)}")
settings = snap["allocator_settings"]
for key, kind in [("PYTORCH_CUDA_ALLOC_CONF", str), ("max_split_size", int),
                  ("garbage_collection_threshold", float), ("expandable_segments", bool),
                  ("pinned_num_register_threads", int), ("release_lock_on_cudamalloc", bool),
                  ("pinned_use_cuda_host_register", bool), ("roundup_power2_divisions", dict)]:
    check(isinstance(settings.get(key), kind), f"allocator_settings[{key!r}] is a {kind.__name__}")
check(sorted(settings["roundup_power2_divisions"], key=int) == [str(1 << i) for i in range(16)],
      "roundup_power2_divisions buckets 1..32768 MiB")
# Phases: PyTorch's record_function annotations (`_memory_snapshot_pickled` in
# torch/csrc/cuda/memory_snapshot.cpp: the annotation's metadata, then device and time_us).
annotations = snap["external_annotations"]
check(isinstance(annotations, list), "external_annotations is a list")
for i, a in enumerate(annotations):
    check(sorted(a) == ["device", "name", "stage", "time_us"], f"annotation {i}: keys {list(a)}")
    check(a["stage"] in ("START", "END") and isinstance(a["name"], str), f"annotation {i}: stage, name")
    check(a["device"] == expected["device"], f"annotation {i}: device")
    check(isinstance(a["time_us"], int) and a["time_us"] > 1_600_000_000_000_000, f"annotation {i}: time_us")
marks = [[a["name"], a["stage"]] for a in annotations]
check(marks == expected.get("annotations", []), f"annotations {marks}")

SEGMENT_KEYS = ["device", "address", "total_size", "allocated_size", "active_size",
                "requested_size", "stream", "segment_type", "segment_pool_id", "is_expandable",
                "frames", "blocks"]
BLOCK_KEYS = ["address", "size", "requested_size", "state", "frames"]
STATES = {"active_allocated", "active_pending_free", "inactive"}


def check_frames(frames, where):
    check(isinstance(frames, list), f"{where}: frames is a list")
    for fr in frames:
        check(list(fr) == ["name", "filename", "line"], f"{where}: frame keys {list(fr)}")
        check(isinstance(fr["name"], str) and isinstance(fr["filename"], str)
              and isinstance(fr["line"], int), f"{where}: frame types")


segments = snap["segments"]
check([s["address"] for s in segments] == sorted(s["address"] for s in segments),
      "segments in address order")
total = {"reserved": 0, "allocated": 0, "active": 0, "requested": 0}
free_external = free_internal = seg_allocated_all = 0
pool_segments = {}
for s in segments:
    where = f"segment {s['address']:#x}"
    check(list(s) == SEGMENT_KEYS, f"{where}: keys {list(s)}")
    check(s["device"] == expected["device"], f"{where}: device")
    check(s["segment_type"] in ("large", "small"), f"{where}: segment_type")
    pool_id = s["segment_pool_id"]
    check(isinstance(pool_id, tuple) and len(pool_id) == 2 and pool_id[0] == 0
          and isinstance(pool_id[1], int) and pool_id[1] >= 0,
          f"{where}: segment_pool_id is a tuple (0, n), as PyTorch's user pools: {pool_id}")
    if pool_id[1]:
        pool_segments[str(pool_id[1])] = pool_segments.get(str(pool_id[1]), 0) + 1
    check(s["is_expandable"] is expected.get("expandable", False), f"{where}: is_expandable")
    check_frames(s["frames"], where)
    cursor = s["address"]
    alloc = active = requested = 0
    ext = internal = seg_alloc = 0
    for b in s["blocks"]:
        bw = f"{where} block {b['address']:#x}"
        check(list(b) == BLOCK_KEYS, f"{bw}: keys {list(b)}")
        check(b["address"] == cursor, f"{bw}: blocks tile the segment (expected {cursor:#x})")
        check(b["state"] in STATES, f"{bw}: state {b['state']}")
        check_frames(b["frames"], bw)
        cursor += b["size"]
        if b["state"] != "inactive":
            active += b["size"]
            check(0 < b["requested_size"] <= b["size"], f"{bw}: requested_size")
            # requested_bytes drops when a free completes (PyTorch's free_block): a block
            # pending on another stream's event still counts.
            requested += b["requested_size"]
        if b["state"] == "active_allocated":
            alloc += b["size"]
            # _memory_viz.py segsum: allocated counts requested bytes, rounding is internal.
            seg_alloc += b["requested_size"]
            internal += b["size"] - b["requested_size"]
        else:
            ext += b["size"]
    check(cursor == s["address"] + s["total_size"], f"{where}: block sizes add to total_size")
    check(s["allocated_size"] == alloc, f"{where}: allocated_size {s['allocated_size']} != {alloc}")
    check(s["active_size"] == active, f"{where}: active_size")
    check(ext + internal + seg_alloc == s["total_size"], f"{where}: free + allocated == reserved")
    free_external += ext
    free_internal += internal
    seg_allocated_all += seg_alloc
    total["reserved"] += s["total_size"]
    total["allocated"] += alloc
    total["active"] += active
    total["requested"] += requested
check(free_external + free_internal + seg_allocated_all == total["reserved"],
      "overall free + allocated == reserved (_memory_viz.py stats)")
for key in total:
    check(total[key] == expected[key], f"total {key}: snapshot {total[key]} != memory_stats {expected[key]}")
check(pool_segments == expected.get("pool_segments", {}),
      f"segments per private pool (segment_pool_id (0, n)): {pool_segments}")
print(f"segments: {len(segments)} segments, {sum(len(s['blocks']) for s in segments)} blocks, totals equal memory_stats")

# The history.
trace = traces[expected["device"]]
ACTIONS = {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
           "segment_map", "segment_unmap", "snapshot", "oom"}
last_time = 0
for i, e in enumerate(trace):
    check(e["action"] in ACTIONS, f"entry {i}: action {e['action']}")
    for key in ("size", "stream", "time_us"):
        check(isinstance(e.get(key), int), f"entry {i}: {key}")
    check(isinstance(e["compile_context"], str) and isinstance(e["user_metadata"], str), f"entry {i}: strings")
    check(e["time_us"] >= last_time and e["time_us"] > 1_600_000_000_000_000, f"entry {i}: time_us")
    last_time = e["time_us"]
    if e["action"] == "oom":
        check("addr" not in e and isinstance(e["device_free"], int), f"entry {i}: oom fields")
    else:
        check(isinstance(e["addr"], int), f"entry {i}: addr")
    if "frames" in e:
        check_frames(e["frames"], f"entry {i}")
# Scopes: each alloc entry's user_metadata (torch.cuda.memory._set_memory_metadata's string).
if "user_metadata" in expected:
    tagged = {}
    for e in trace:
        if e["action"] == "alloc" and e["user_metadata"]:
            tagged[e["user_metadata"]] = tagged.get(e["user_metadata"], 0) + 1
    check(tagged == expected["user_metadata"], f"alloc entries per user_metadata {tagged}")
counts = {a: sum(1 for e in trace if e["action"] == a) for a in ACTIONS}
for action, least in expected["at_least"].items():
    check(counts[action] >= least, f"{counts[action]} {action} entries, expected at least {least}")

# Backwards, as MemoryViz.js's segment view does: undo every entry from the newest.
# Ordinary segments by address; expandable memory as its mapped 2 MiB pages (every map and
# unmap is whole pages of 2 or 20 MiB, aligned to them).
PAGE = 2 << 20
seg_map = {s["address"]: s["total_size"] for s in segments if not s["is_expandable"]}
pages = {p for s in segments if s["is_expandable"]
         for p in range(s["address"], s["address"] + s["total_size"], PAGE)}


def page_range(e):
    check(e["addr"] % PAGE == 0 and e["size"] % PAGE == 0, f"{e['action']} of whole pages")
    return set(range(e["addr"], e["addr"] + e["size"], PAGE))
blocks = {}
for s in segments:
    for b in s["blocks"]:
        if b["state"] != "inactive":
            blocks[b["address"]] = {"size": b["size"], "pending": b["state"] == "active_pending_free"}


def inside_a_segment(addr):
    return any(a <= addr < a + size for a, size in seg_map.items()) or addr // PAGE * PAGE in pages


for i in range(len(trace) - 1, -1, -1):
    e = trace[i]
    a = e["action"]
    if a == "free_completed":
        check(e["addr"] not in blocks, f"undo entry {i}: free_completed of a live address")
        blocks[e["addr"]] = {"size": e["size"], "pending": True}
    elif a == "free_requested":
        check(e["addr"] in blocks, f"undo entry {i}: free_requested with no block at {e['addr']:#x}")
        blocks[e["addr"]]["pending"] = False
    elif a == "alloc":
        check(e["addr"] in blocks, f"undo entry {i}: alloc with no block at {e['addr']:#x}")
        del blocks[e["addr"]]
    elif a == "segment_free":
        check(e["addr"] not in seg_map, f"undo entry {i}: segment_free of a live segment")
        seg_map[e["addr"]] = e["size"]
    elif a == "segment_alloc":
        check(seg_map.get(e["addr"]) == e["size"], f"undo entry {i}: segment_alloc of no such segment")
        del seg_map[e["addr"]]
    elif a == "segment_unmap":
        check(not (page_range(e) & pages), f"undo entry {i}: segment_unmap of mapped pages")
        pages |= page_range(e)
    elif a == "segment_map":
        check(page_range(e) <= pages, f"undo entry {i}: segment_map of pages not mapped")
        pages -= page_range(e)
    for addr in blocks:
        check(inside_a_segment(addr), f"undo entry {i}: block {addr:#x} outside every segment")

# Forwards from there: every free matches a live allocation at its address.
live = {addr: b for addr, b in blocks.items()}
frees = 0
for i, e in enumerate(trace):
    a = e["action"]
    if a == "alloc":
        check(e["addr"] not in live, f"entry {i}: alloc at a live address {e['addr']:#x}")
        check(inside_a_segment(e["addr"]), f"entry {i}: alloc outside every segment")
        live[e["addr"]] = {"size": e["size"], "pending": False}
    elif a == "free_requested":
        check(e["addr"] in live and not live[e["addr"]]["pending"],
              f"entry {i}: free_requested matches no live allocation at {e['addr']:#x}")
        live[e["addr"]]["pending"] = True
        frees += 1
    elif a == "free_completed":
        check(e["addr"] in live and live[e["addr"]]["pending"],
              f"entry {i}: free_completed matches no freed allocation at {e['addr']:#x}")
        del live[e["addr"]]
    elif a == "segment_alloc":
        seg_map[e["addr"]] = e["size"]
    elif a == "segment_free":
        check(e["addr"] in seg_map, f"entry {i}: segment_free of no segment")
        end = e["addr"] + e["size"]
        check(not any(e["addr"] <= b < end for b in live), f"entry {i}: segment_free under a live block")
        del seg_map[e["addr"]]
    elif a == "segment_map":
        check(not (page_range(e) & pages), f"entry {i}: segment_map of mapped pages")
        pages |= page_range(e)
    elif a == "segment_unmap":
        check(page_range(e) <= pages, f"entry {i}: segment_unmap of pages not mapped")
        end = e["addr"] + e["size"]
        check(not any(e["addr"] <= b < end for b in live), f"entry {i}: segment_unmap under a live block")
        pages -= page_range(e)
final = {addr for s in segments for b in s["blocks"] if b["state"] != "inactive" for addr in [b["address"]]}
check(set(live) == final, "replaying the history forwards ends at the snapshot's live blocks")
print(f"history: {len(trace)} entries replay backwards and forwards; {frees} frees each match a live allocation")

# Stacks.
if expected.get("stack_function"):
    fn = expected["stack_function"]
    allocs = [e for e in trace if e["action"] == "alloc"]
    check(allocs and all("frames" in e for e in allocs), "every alloc entry carries frames")
    check(all(any(fn in fr["name"] for fr in e["frames"]) for e in allocs),
          f"every alloc entry's frames name {fn}")
    live_blocks = [b for s in segments for b in s["blocks"] if b["state"] == "active_allocated"]
    check(any(any(fn in fr["name"] for fr in b["frames"]) for b in live_blocks),
          f"live blocks' frames name {fn}")
    print(f"stacks: every alloc entry's frames name {fn}")
print("OK")
