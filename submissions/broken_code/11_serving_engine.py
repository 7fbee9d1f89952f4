# %% ch11.1
def block_hashes(token_ids, adapter_id, block_size):
    # a generator of keys, not a list (and Python's per-process hash)
    return (hash((adapter_id, tuple(token_ids[i:i + block_size]))) for i in range(0, len(token_ids), block_size))


# %% ch11.2
def admit_requests(waiting, running_uids, resident_uids, max_loras_per_batch, free_blocks, max_new_seqs,
                   draining=None, drain_active=False):
    # sorts the caller's list in place, then returns the Candidate objects instead of their seq_ids
    waiting.sort(key=lambda c: c.blocks_needed)
    return waiting[:max_new_seqs]


# %% ch11.3
def choose_drain(waiting, running_remaining, max_loras_per_batch, threshold):
    # pops the victim out of the caller's dict and returns it alone, not the pair (True, uid)
    if len(running_remaining) >= max_loras_per_batch:
        victim = min(running_remaining, key=running_remaining.get)
        running_remaining.pop(victim)
        return victim
    return None


# %% ch11.4
def route(adapter_key, loads, vnodes, capacity_factor, replicas=1):
    # the instance's name instead of its index
    return f"instance-{loads.index(min(loads))}"


# %% ch11.5
def engine_step(scheduler, runner):
    # SeqWork used without importing it (a NameError once called); with this learner's ch11.1-ch11.3
    # the engine fails earlier still: their admit_requests returns Candidates, not seq_ids
    kind, work = scheduler.schedule()
    batch = [SeqWork(w.seq.tokens[w.start:w.end], w.start, w.seq.block_table, w.seq.uid) for w in work]
    logits = runner.forward(batch)
    scheduler.postprocess(work, {w.seq.seq_id: int(row.argmax()) for w, row in zip(work, logits)})
    return kind
