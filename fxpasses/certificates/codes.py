"""The one registry of reason codes.

Every refusal, run-time fallback and internal failure that fxpasses reports carries a code from
this table. Codes are stable identifiers (tests assert codes, never message text); the explanation
is one line, the hint says what a user can do about it. ``docs/codes.md`` is generated from this
table (``python -m fxpasses.certificates.codes > docs/codes.md``) and a test keeps it in sync.

Kinds:
  refusal  a pass considered a site and did not rewrite it (decision "refused")
  guard    a run-time check failed, so a call (or one site of a call) ran natively
  failure  something broke inside fxpasses; the affected work ran natively (decision "failed")
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("refusal", "guard", "failure")


@dataclass(frozen=True, slots=True)
class Code:
    name: str
    kind: str
    explanation: str
    hint: str
    needs: str | None = None  # the optional package without which nothing can make it occur


_CODES = (
    # -- tracing and the pipeline -----------------------------------------------------------
    Code("trace-unsupported", "refusal",
         "The loss does something a concrete trace cannot record (its values leave torch: "
         ".numpy(), backward() inside the loss, an in-place write to a tensor the trace does not "
         "follow, a switch of autocast, inference mode or the default dtype or device inside the loss).",
         "Declare the function that does it a leaf: optimize(..., leaf_functions=[fn])."),
    Code("trace-failed", "refusal",
         "Tracing the loss raised an exception.",
         "Declare the failing function or module a leaf, or simplify the code at the named line."),
    Code("trace-write-before-guard", "refusal",
         "The loss writes to an input, a parameter or a buffer before a data-dependent decision "
         "the trace guards: a call that decides otherwise could not be abandoned without a "
         "visible effect.", "Move the in-place update after the decision, or out of the loss."),
    Code("assumption-changed", "guard",
         "A value the trace read from the loss's state (an attribute, a dict of gains, a global, "
         "an argument's field, a module's identity) changed; the loss was traced again for it "
         "(or ran natively once the specializations were spent).",
         "Expected when settings change; floats read as arithmetic are inputs and never cause it."),
    Code("guard-failed", "guard",
         "A decision the trace took on a value (a size, if mask.any(), an .item()) went the "
         "other way in this call; the optimized call was abandoned and ran natively.",
         "Expected on unusual batches; a decision that keeps failing gets its own trace."),
    Code("pass-raised", "failure",
         "A pass raised an exception; the graph from before the pass was kept.",
         "Report it with the certificate JSON; the loss keeps its previous graph."),
    Code("lint-failed", "failure",
         "The graph failed graph.lint() after a pass; the graph from before the pass was kept.",
         "Report it with the certificate JSON; the loss keeps its previous graph."),
    Code("stored-result-absent", "refusal",
         "No stored pipeline result has this trace's key (the first process to trace it, or the "
         "graph, the loss's structure or sources, the passes, the device, fxpasses or torch "
         "changed since: the certificate names the parts in which the newest entry differs); "
         "the passes ran and their result was stored.",
         "Expected once per key; later processes read it back."),
    Code("stored-result-unusable", "refusal",
         "A stored pipeline result has this trace's key but could not be used (an unreadable or "
         "torn entry, an object it refers to that the loss does not hold, a tensor a rewrite "
         "folded that holds other values, code that does not match the code stored); the "
         "passes ran again and their result replaced it.", "None needed; the message says why."),
    Code("result-unkeyable", "refusal",
         "What the passes read cannot all be written into a portable key (an object of a user "
         "class that the loss does not hold, a function without an importable name, a fake "
         "tensor): nothing was looked up or stored; the passes ran.",
         "Hold the object on the loss, or name the function at module level."),
    Code("result-not-storable", "refusal",
         "The passes' result refers to something that cannot be written and read back in "
         "another process (an object the loss does not hold, a lock, a symbolic size): it "
         "serves this process only.", "Report it with the certificate's evidence."),
    Code("metadata-failed", "failure",
         "Propagating shapes through the graph with fake tensors failed at a node: in the traced "
         "graph (passes then treat that node and what follows conservatively), or after a pass "
         "(that pass's graph was discarded).",
         "Report it with the exception; the loss still runs, with fewer rewrites."),
    Code("fingerprint-mismatch", "failure",
         "A pass said it changed the graph and did not, or changed it and said it did not.",
         "A bug in that pass: report it. Its result was discarded."),
    # -- whole-loss guards, checked on every call -----------------------------------------
    Code("hook-added", "guard",
         "A forward, forward-pre or backward hook was registered (globally, or on the loss or a "
         "module a trace depends on) after the trace, or one it saw was removed.",
         "Register hooks before optimize(), or call .reoptimize() after registering them."),
    Code("method-replaced", "guard",
         "A method of the loss or of a module a trace depends on was replaced (instance or "
         "class) after the trace.",
         "Patch methods before optimize(), or call .reoptimize()."),
    Code("module-replaced", "guard",
         "A submodule of the loss or of a module a trace depends on was replaced by another "
         "object after the trace.",
         "Replace modules before optimize(), or call .reoptimize()."),
    Code("mode-changed", "guard",
         "The train/eval mode of the loss or of a module a trace depends on differs from the "
         "one the trace saw.",
         "Expected during validation: eval calls run natively."),
    Code("autocast-changed", "guard",
         "The autocast state (enabled, dtype) differs from the one recorded at tracing.",
         "Optimize under the autocast context you train with."),
    Code("default-dtype-changed", "guard",
         "torch's default dtype (torch.set_default_dtype) differs from the one at tracing: the "
         "loss's factories and Python floats would make other dtypes than the trace recorded.",
         "Set the default dtype before the first call; a call under another one is traced apart."),
    Code("grad-mode-changed", "guard",
         "Grad mode differs from the one recorded at tracing (e.g. a no_grad validation call).",
         "Expected under torch.no_grad(): such calls run natively."),
    Code("specialization-budget", "guard",
         "A new input structure or loss attribute value would need another trace, and the budget "
         "of specializations is spent.",
         "Raise optimize(..., max_specializations=N) or keep non-tensor inputs stable."),
    Code("optimized-path-raised", "guard",
         "The optimized path raised an exception that the native loss did not raise on the same "
         "call; the call was recomputed natively (its attribute writes undone first) and the "
         "exception recorded in stats.exceptions. The specialization keeps running.",
         "Read the recorded exception and node in explain(); report it if it is fxpasses' fault."),
    Code("optimized-path-disabled", "guard",
         "The specialization's optimized path raised on several calls in a row that the native "
         "loss ran without error; it was disabled and the calls it covers run natively.",
         "Read the recorded exceptions in explain(); report them if they are fxpasses' fault."),
    Code("native-raised", "guard",
         "The optimized path raised and so did the native loss on the same call (a wrong input, "
         "say): native's exception was raised, as natively; the specialization keeps running.",
         "Fix the call's inputs; later valid calls run optimized."),
    # -- call pairing (PairCalls / PairRLE) -----------------------------------------------
    Code("no-site", "refusal",
         "The pass found nothing in the graph to rewrite (no call of the methods it pairs, no "
         "node it handles): it changed nothing.",
         "A module the trace went through has no call of its own in the graph: declare it a leaf "
         "(optimize(..., leaf_modules=[...])) or name its method in density_methods=."),
    Code("pair-single-call", "refusal",
         "Only one call of this module method is in the graph: nothing to pair it with.",
         "Nothing to do; pairing needs two calls of the same module and method."),
    Code("pair-different-module", "refusal",
         "The two calls go to different module objects (two flows with their own weights).",
         "Share one module between the branches if they are meant to share weights."),
    Code("method-overridden", "refusal",
         "A subclass overrides inherited scoring or density code (altered scoring / custom "
         "density), so the certified implementation is not the one that runs.",
         "If the override is intended, pass PairRLE(allow_overrides=(YourClass,))."),
    Code("method-patched", "refusal",
         "The method is replaced on the instance (monkeypatched) rather than the class's own.",
         "Remove the instance attribute, or subclass and allow the override explicitly."),
    Code("hooks-present", "refusal",
         "The module or one of its submodules has forward, forward-pre or backward hooks; "
         "pairing would change how often and on what they fire.",
         "Remove the hooks, or keep native calls."),
    Code("global-hooks-present", "refusal",
         "Global module hooks are registered (torch.nn.modules.module.register_module_*_hook).",
         "Remove the global hooks, or keep native calls."),
    Code("compiled-module", "refusal",
         "The module or a submodule is compiled (torch.compile / Module.compile).",
         "Pair the uncompiled module, or keep native calls."),
    Code("not-training", "refusal",
         "The module is in eval mode; validation keeps its native calls.",
         "Optimize in training mode; eval calls run natively."),
    Code("calls-dependent", "refusal",
         "One call's input depends on the other call's output, so they cannot run as one.",
         "Nothing to do: the calls are sequential by construction."),
    Code("pair-call-signature", "refusal",
         "A call passes arguments other than the rows (extra arguments or keywords).",
         "Pairing stacks one row tensor per call; calls with other arguments keep native calls."),
    Code("pair-row-shape-mismatch", "refusal",
         "The branches' rows differ in trailing shape, or a trailing size depends on data.",
         "Rows can only be stacked when every dimension but the first agrees."),
    Code("pair-reorder-mutation", "refusal",
         "Merging the calls would move an in-place or side-effecting op past other nodes, or move "
         "a node into a different grad mode.",
         "Avoid in-place ops between the two branches' calls, or keep native calls."),
    Code("pair-state-written", "refusal",
         "The paired method writes the loss's Python state (an attribute: a call counter, a "
         "cache); one paired call would write it once where the separate calls write it once each.",
         "Keep native calls, or move the write out of the scored method."),
    Code("pair-gradient-undecided", "refusal",
         "Whether a gradient reaches one branch's results cannot be told from the graph (they "
         "pass code the analysis cannot see through: a leaf function or module whose result may "
         "or may not carry a gradient, a write into other memory or into the loss's state): "
         "natively that branch's rows may get no gradient (None), the paired call would give "
         "them a zero one.",
         "Let the branch's results reach the loss through torch ops, or detach them where no "
         "gradient is meant to flow; the calls keep their native form."),
    Code("select-state-written", "refusal",
         "A call kept whole in the region that reads the selected rows (a leaf module, a density "
         "method) writes the loss's Python state; gathered into a capacity, it would see padding "
         "rows and could write what native calls do not.",
         "Keep native selections, or move the write out of that call."),
    Code("pair-witness-mismatch", "refusal",
         "The float64 witness found the paired call differs from the separate calls beyond rounding, "
         "or the separate calls raise on its sample rows (an empty branch, say).",
         "The analysis missed something: report it with the certificate JSON."),
    Code("rows-op-unknown", "refusal",
         "The module runs an op that is not in the row-preserving table.",
         "If the op maps rows to rows, add a rule to fxpasses.analysis.row_rules."),
    Code("rows-mixed", "refusal",
         "The module combines values across rows (a reduction, sort, scan or matmul over the row "
         "dimension, or training-mode batch statistics).",
         "Such a module is not row-independent; pairing would change its results."),
    Code("rows-state-mutated", "refusal",
         "The module mutates a parameter or buffer in place (e.g. a counter or data-dependent "
         "initialisation); pairing would change how often that happens.",
         "Keep native calls, or move the state update out of the scored method."),
    Code("rows-shape-dependent", "refusal",
         "The module runs different ops for different row counts (Python control flow on the "
         "number of rows).",
         "Remove the row-count branch from the scored method."),
    Code("rows-data-dependent", "refusal",
         "The module reads tensor data on the host (.item(), nonzero, a data-dependent shape), so "
         "the ops it runs depend on values the row analysis cannot follow.",
         "Keep the value on the device (masks, torch.where), or keep native calls."),
    Code("rows-analysis-failed", "refusal",
         "The module could not be traced on concrete example rows (make_fx raised).",
         "Read the evidence; the module keeps its native calls."),
    Code("pair-dtype-mismatch", "guard",
         "At run time the two branches' rows had different dtypes; this call ran two native calls.",
         "Expected when branches are computed in different precisions."),
    Code("pair-device-mismatch", "guard",
         "At run time the two branches' rows were on different devices; this call ran two native "
         "calls.", "Keep both branches on one device."),
    Code("pair-tensor-subclass", "guard",
         "At run time a branch's rows were a tensor subclass; this call ran two native calls.",
         "Pass plain torch.Tensor rows."),
    # -- selections with a static capacity (SelectRows) -----------------------------------
    Code("select-mask-shape", "refusal",
         "The boolean mask does not index the leading dims of what it selects from, or its shape "
         "holds the rows of several selections (every pair of two selections' rows).",
         "Select with a mask shaped as the leading dims of the tensor (x[m], m.shape == "
         "x.shape[:m.dim()])."),
    Code("select-boundary", "refusal",
         "Selected rows leave the analysed part other than through a reduction over the rows "
         "that the rewrite can mask (sum, mean, a loss with reduction=), a further selection, a "
         "row-independent call or a graph output: padding rows would reach a result.",
         "Reduce the selected rows with sum or mean (or a loss's reduction=) before combining "
         "them with anything else."),
    Code("select-parent-refused", "refusal",
         "The mask carries the rows of an earlier selection that was not rewritten, so its row "
         "count is still data-dependent.", "Read the certificate of the earlier selection."),
    Code("select-effect-before-read", "refusal",
         "Something visible happens before the mask is computed (a write to an input, a "
         "parameter, a buffer or an attribute, a random draw, user code): a call whose count "
         "does not fit its capacity is abandoned at the later read, and could not be unseen.",
         "Move the write or the draw after the selections, or out of the loss."),
    Code("select-witness-mismatch", "refusal",
         "The float64 witness found the rewritten selection differs from the native one (values "
         "or gradients), or raises where the native does not.",
         "The analysis missed something: report it with the certificate JSON."),
    Code("selection-capacity", "guard",
         "At run time a selection's count exceeded the capacity its rows were gathered into "
         "(chosen from earlier calls, before the count was known): the call was abandoned before "
         "anything was visible and ran again at once with the capacity grown to the count's bucket.",
         "Expected a few times early in training, as the largest count grows; each costs one "
         "forward run twice."),
    Code("selection-empty", "guard",
         "At run time a selection rewritten to a static capacity came out empty (no real row to "
         "pad with); the call ran natively.",
         "Expected now and then (a batch without foreground); frequent ones cost a native call."),
    Code("bincount-not-bounded", "refusal",
         "A torch.bincount keeps its own host reads (the minimum and maximum of its input): it has "
         "weights or no minlength, its input is not a 1-D integer tensor, or the next host read "
         "after it is not int(counts.max()) of its result with every other use of the counts after it.",
         "Nothing to do; the bincount runs as written."),
    Code("unique-not-count-max", "refusal",
         "A unique(return_counts=True) keeps its host read (its output's length): its input is not "
         "an integer tensor, it returns inverse indices or works along a dim, or its values or "
         "counts are used for more than the largest count.",
         "Nothing to do; the unique runs as written."),
    Code("counts-out-of-range", "guard",
         "At run time a value counted by a bincount rewritten to minlength bins lay outside "
         "[0, minlength) (an image index at or above the batch size, or negative): the call was "
         "abandoned at the read of the counts' maximum and ran natively.",
         "Check the targets' image indices (batch_idx): each should lie in [0, batch size)."),
    Code("largest-count-empty", "guard",
         "At run time the largest count of a unique (counts.max(), rewritten to count without a host "
         "read) was asked of no values: native raises there, or never gets there (a branch of its own "
         "on an empty batch, which a pass may have moved the count before): the call was abandoned "
         "and ran natively, which does either.",
         "Nothing to do for a batch without targets; it runs natively."),
    Code("read-overlap-none", "refusal",
         "No node after a count read could be issued before it (each needs the counts or a "
         "node that does, is a check point of the read, or conflicts with a node it would pass): "
         "the host waits for the counts' copy with nothing to issue.",
         "Nothing to do; the stayed reasons in the certificate's evidence say what holds each back."),
    Code("count-work-not-moved", "refusal",
         "Two count reads of SelectRows stay two waits: what the later read's counts need is "
         "computed after the earlier read, and it may not run before that read (it needs the "
         "earlier read's results, is a check point of either read, writes memory, reads on the "
         "host, draws random numbers, has unknown effects, or conflicts with a node it would pass).",
         "Nothing to do; each read waits for the device on its own. The certificate's evidence "
         "names the node that holds the work back."),
    Code("work-not-moved-into-region", "refusal",
         "Two captured regions stay two: barriers (an in-place write whose shape varies per call, a "
         "host read) stand between them, and the earlier region's work that only the later side "
         "needs could not move after them (a node is used before the later region, writes memory, "
         "reads on the host, draws random numbers, runs in another grad mode, or conflicts with a "
         "node it would pass), or the regions would then hold as many static buffers or more.",
         "Nothing to do; each region replays on its own. The certificate's evidence names the "
         "nodes held back and why."),
    Code("reads-not-joined", "refusal",
         "The loss reads several scalars on the host (sizes read from its targets), and none after "
         "the first could be read with it in one transfer: what a later read needs is computed after "
         "the first by a node that writes memory, reads on the host, draws random numbers, has "
         "unknown effects or conflicts with a node it would pass, or a node between the two reads "
         "may write what the later one reads.",
         "Nothing to do; each read waits for the device on its own. The certificate's evidence "
         "names the node that holds each read back."),
    # -- loss capture (CaptureLoss) -------------------------------------------------------
    Code("duplicate-impure", "refusal",
         "A node computes what an earlier one did, but one of the two may write memory, draws "
         "random numbers or was not propagated to the end, or the two made values of different "
         "dtypes, devices or kinds from the same arguments (the op reads state they do not "
         "show): it is not shared, both run.",
         "Nothing to do; the two computations stay separate."),
    Code("duplicate-written", "refusal",
         "A node computes what an earlier one did, but the memory of one of them or of an input "
         "is written in place somewhere in the loss (or resized in place): sharing one value "
         "could let one branch's write reach the other, so both run.",
         "Write out of place (x = x * 2) where a value is computed twice."),
    Code("duplicate-autograd", "refusal",
         "A node computes what an earlier one did, but a value or an input carries autograd "
         "history: a grad mode switched between them could differ, so both run.",
         "Nothing to do; the two computations stay separate."),
    Code("not-on-capture-device", "refusal",
         "The loss's tensors are on devices CaptureLoss does not capture (CPU tensors with the "
         "default capture devices, cuda): nothing to capture.",
         "Run the loss on a CUDA device to capture it."),
    Code("cuda-unavailable", "refusal",
         "CaptureLoss captures CUDA tensors and CUDA is not available in this process.",
         "Nothing to do on a machine without a GPU; the loss runs without capture."),
    Code("device-not-captured", "refusal",
         "A tensor of this node lies on a device that is not captured (a CPU tensor in a CUDA "
         "loss, a host transfer); the node runs eagerly between regions.",
         "Move the tensor to the loss's device once, outside the loss."),
    Code("op-unknown", "refusal",
         "The node runs user code (a leaf function, a user module, a method fxpasses does not "
         "know) whose effects are not visible as ops; it runs eagerly, and no region is moved "
         "across it.", "Inline the code into the loss or declare nothing a leaf that need not be."),
    Code("op-attribute-write", "refusal",
         "The node writes an attribute of the loss's state (``self.bs = ...``): Python, not a "
         "kernel, so it runs eagerly. No captured op reads Python attributes, so regions may span "
         "it, unless fusing a region would move it past a read or write of that attribute; then "
         "no region is moved across it.", "Nothing to do."),
    Code("op-in-place", "refusal",
         "The node writes to one of its inputs or to module state (an in-place op, batch-norm "
         "statistics); it runs eagerly, and no region is moved across it.",
         "Use the out-of-place op (x = x + y) where the value is not shared."),
    Code("write-old-value-read", "refusal",
         "An in-place write of memory the loss made itself, which no captured region can hold "
         "with every node touching that memory, cannot run on a copy instead: that memory's old "
         "value is read after the write (through a view or a name taken before it), so the "
         "write stays a barrier.",
         "Take views after the write, or write out of place (x = x * 2) where the old value is kept."),
    Code("view-of-written-memory", "refusal",
         "The node shares memory with a value outside its region (a view of the region's input, "
         "or of another of its outputs) that an in-place write changes later: a region hands out "
         "its own copy of each output, which would miss the write, so the node runs eagerly.",
         "Take the view after the write, or write out of place."),
    Code("op-grad-mode", "refusal",
         "A grad-mode switch (no_grad / enable_grad) that no region holds with its whole block "
         "and whose block cannot be partitioned among regions (the block calls user code, nests "
         "a switch to another mode, runs an eager op that depends on the grad mode, or has nodes "
         "in a region too small to capture): regions never span it; it runs eagerly.",
         "Nothing to do: regions form on each side of the switch."),
    Code("op-random", "refusal",
         "The node draws random numbers; a replay would draw them differently from eager, so "
         "it runs eagerly.", "Draw random numbers outside the loss if the loss must be captured."),
    Code("op-no-metadata", "refusal",
         "Shape propagation did not reach the node (an earlier node failed it); it runs eagerly "
         "and no region is moved across it.",
         "Read the metadata-failed certificate for the node that failed."),
    Code("host-sync", "refusal",
         "An op reads device data on the host (.item(), nonzero, boolean-mask indexing) or copies "
         "host data to the device inside itself (torch.tensor(data, device=d), x[[1, 0]]), which "
         "a CUDA graph cannot capture; it runs eagerly between regions.",
         "Express the selection with static shapes (masks, clamped counts) to capture it."),
    Code("dynamic-shape", "refusal",
         "The node's shape depends on data (downstream of a data-dependent op); it runs eagerly.",
         "Reduce to a static shape (sum/mean) before the next region, or use static selections."),
    Code("rows-vary-per-call", "refusal",
         "The node's value follows the row count of an input table (one row per labelled object: "
         "batch_idx, boxes, keypoints), which changes with every batch, or it reads such a value; "
         "a region holding it would record again for nearly every call, so it runs eagerly, in "
         "front of the regions that read what it builds. Measured by propagating the tables at "
         "another row count (fxpasses.analysis.varying_rows).",
         "Nothing to do: these are the cheap steps that pack targets per image."),
    Code("padding-not-inert", "refusal",
         "A zero buffer sized from data (the most objects in an image) was not rounded up to a "
         "capacity: run on the traced call with extra zero slots, the loss gave other values or "
         "gradients (the witness's differences are in the certificate); its nodes stay one "
         "recording per size, or eager.",
         "Nothing to do; the loss reads its padding slots (a mean over them, a count of them)."),
    Code("padding-witness-unavailable", "refusal",
         "A zero buffer sized from data was not rounded up to a capacity: the witness that runs "
         "the loss at both sizes could not run (no example call, or the run was abandoned or "
         "raised; the certificate names it).",
         "Report it with the certificate if the loss runs natively on the same call."),
    Code("region-not-convex", "refusal",
         "A path leaves the planned region and comes back into it: fused into one call, the graph "
         "would be cyclic, so the region is not captured (the planner should never propose it).",
         "Report it: the region planner proposed a region it cannot fuse."),
    Code("device-constant-written", "refusal",
         "A tensor the loss makes on the host from numbers and copies to the device (a grid, "
         "an image-size tensor) is written, or handed out by the output, downstream: one tensor "
         "made once cannot stand for a fresh one each call, so the copy (a wait) stays.",
         "Nothing to do; clone it before writing it in the loss to let it be made once."),
    Code("scalar-stays-constant", "refusal",
         "A float the loss reads each call multiplies a tensor that is not float32 or float64 "
         "(float16, bfloat16: CUDA multiplies them by the float in float32 arithmetic, where a "
         "0-dim tensor of their dtype would round the float first), or one on no capture device: "
         "the float stays a constant of the region's recordings, and a new value records again.",
         "Nothing to do; a value that changes rarely costs one recording per change."),
    Code("region-too-small", "refusal",
         "The capturable region launches too few kernels for a replay to pay off: fewer than "
         "min_region_ops, or fewer than the tensors a replay would copy in and out.",
         "Lower CaptureLoss(min_region_ops=...) if you want it captured anyway."),
    Code("padding-unsafe", "refusal",
         "Zero rows appended to a paired call's rows change the real rows' values or gradients (or "
         "give non-finite derivatives), so the call cannot run padded to a row bucket.",
         "The paired call runs eagerly between regions; nothing to do."),
    Code("awaiting-repeat", "guard",
         "The region's input signature is new: it runs natively and is recorded when it recurs "
         "(a shape seen once, as data-dependent shapes often are, would be recorded for nothing).",
         "Nothing to do; CaptureLoss(record_after=1) records a signature on its first call."),
    Code("record-budget", "guard",
         "The region has made its budget of recordings (four times max_recordings in all, "
         "evictions included), or every recording it keeps is still referenced; this signature "
         "runs natively.",
         "Raise CaptureLoss(max_recordings=...) or keep the region's input shapes stable."),
    Code("capture-failed", "failure",
         "Recording the region into a CUDA graph raised; the region runs natively from now on.",
         "Read the recorded exception; report it if the op table let an unsafe op in."),
    Code("outputs-alive", "guard",
         "A tensor still refers to the static memory of one of the region's recordings (an "
         "output the caller kept, or one an earlier call saved for its pending backward); the "
         "recordings share one memory pool, so replaying any of them could overwrite it, and "
         "this call ran the region natively.",
         "Expected when two forwards precede one backward; keep no views of loss intermediates."),
    Code("profiler-active", "guard",
         "A profiler installed with sys.setprofile is running; the trace records the globals the "
         "loss reads with a profile hook of its own, so this call ran natively and is traced on "
         "a later call without the profiler (specializations made before keep running).",
         "Make the first call outside the profiler, or profile with torch.profiler."),
    Code("pipeline-running", "guard",
         "The passes' pipeline for the trace covering this call runs in another process "
         "(optimize(..., background=True)); the call ran natively. The first call after that "
         "process ends reads its result back from the store and runs optimized.",
         "Expected for the seconds the pipeline takes, once per trace a store holds no result for."),
    Code("concurrent-call", "guard",
         "Another thread was inside the same optimized loss or captured region; this call ran "
         "natively.", "Expected when threads share one optimized loss."),
    Code("double-backward-eager", "guard",
         "A backward with create_graph=True (second-order gradients) went through a captured "
         "region; the region's gradient was recomputed eagerly so that it is differentiable.",
         "Expected for gradient penalties; it costs one eager recomputation of the region."),
    Code("stale-backward", "failure",
         "A backward reached a replay whose graph memory a later replay overwrote "
         "(backward(retain_graph=True) again after a new forward); it raised instead of giving a "
         "wrong gradient.", "Run the second backward before the next forward, or drop CaptureLoss."),
    Code("double-backward-state-changed", "failure",
         "A backward with create_graph=True reached a captured region after a value its code "
         "reads from the loss's state (a module's flag) changed since the forward: the eager "
         "recomputation would run other code than the forward did; it raised instead of giving a "
         "wrong gradient.", "Change the setting after the backward, or drop CaptureLoss."),
    Code("replay-pending-backward", "guard",
         "The previous replay's backward has not run yet; replaying would overwrite the "
         "activations it needs, so this call ran the region natively.",
         "Call backward before the next forward (the usual training loop does)."),
    # -- integrations ------------------------------------------------------------------------
    Code("integration-unsupported", "refusal",
         "A training framework's integration could not wrap the model's criterion (no "
         "init_criterion, or optimize() refused it); training runs with the native criterion.",
         "The trainer's log line names the reason; pass the criterion to optimize() yourself.",
         needs="ultralytics"),
)

REGISTRY: dict[str, Code] = {code.name: code for code in _CODES}
assert len(REGISTRY) == len(_CODES), "duplicate code names"
assert all(code.kind in KINDS for code in _CODES)

# What run-time ops count besides reason codes: events of the rewritten path, counted beside the
# codes in their counters (``OptimizedLoss.stats.sites``) but never noted as codes.
EVENTS: dict[str, str] = {
    "paired": "a paired call ran once on the stacked rows of its branches",
    "recorded": "a captured region recorded its function for a new input signature",
    "replayed": "a captured region replayed a recording",
    "evicted": "a captured region dropped its least recently replayed recording to make room",
    "read": "a selection read its row counts to the host (its one synchronisation)",
    "grown": "a selection's capacity grew to fit the rows of a call",
    "outputs-copied": "an output in a captured region's memory was copied before it reached the caller",
}
assert not set(EVENTS) & set(REGISTRY), "an event named like a code"


_observed: set[str] | None = None


def observe() -> set[str]:
    """Start collecting the codes that occur (in certificates, checks and run-time counters);
    returns the live set. A test session uses it to show every code is exercised."""
    global _observed
    if _observed is None:
        _observed = set()
    return _observed


def note(name: str) -> None:
    """``name``, a registered code (a KeyError names an unknown one), occurred: noted when
    collecting (see :func:`observe`). What carries a code (a check, a certificate, an analysis
    result, a verdict, a run-time counter) calls this when it is made."""
    if name not in REGISTRY:
        lookup(name)
    if _observed is not None:
        _observed.add(name)


def lookup(name: str) -> Code:
    """The registered code called ``name``; a KeyError names the unknown code."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown fxpasses code {name!r}; registered: {sorted(REGISTRY)}") from None


def markdown() -> str:
    """The reference page of every code, as committed in docs/codes.md."""
    lines = ["# Reason codes", "",
             "Generated from `fxpasses/certificates/codes.py` by "
             "`python -m fxpasses.certificates.codes`; a test keeps the two in sync.", ""]
    for kind in KINDS:
        lines += [f"## {kind}", "", "| code | explanation | hint |", "| --- | --- | --- |"]
        lines += [f"| `{c.name}` | {c.explanation} | {c.hint} |" for c in _CODES if c.kind == kind]
        lines.append("")
    lines += ["## run-time events", "",
              "Counted by run-time ops beside the codes (`OptimizedLoss.stats.sites`); not reasons.", "",
              "| event | meaning |", "| --- | --- |"]
    lines += [f"| `{name}` | {meaning} |" for name, meaning in EVENTS.items()]
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(), end="")
