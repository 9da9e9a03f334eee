"""Plan by branching the model's execution state: a py_trees behaviour tree over the flashrt node.

The tree tries every candidate instruction from the same starting state and keeps the best outcome::

    Selector "plan or recover"
      Sequence "plan"
        Snapshot "root"                  live state -> capsule, pinned to the device (blackboard: root)
        FailureIsSuccess(Sequence "branch i")   one per candidate; a failed branch is just skipped
          Restore root -> Generate candidate i -> Score -> Snapshot (blackboard: capsule_i)
        SelectBest                       highest score wins, ties go to the earlier candidate
        Restore chosen                   the live state becomes the winning branch
        Drop root and the losing branches
      Sequence "recover"                 only when "plan" failed (e.g. every branch failed)
        Restore root -> Drop every planning capsule -> Failure

Each service/action behaviour sends its request in ``initialise()``, stays RUNNING until the answer
arrives and maps the response's ``success`` / ``error_code`` to SUCCESS / FAILURE (the error goes to
``feedback_message``). Capsule ids and results live on a blackboard namespace private to one plan.

Run against a node: ``python -m flashrt_ros.bt_planner "pick up the cup" "open the drawer"``.
"""
import argparse
import itertools
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace

import py_trees
from py_trees.common import Access, Status

from flashrt_ros.client import ClientError

_plan_ids = itertools.count()


def score_tokens(token_ids, text, keywords=()) -> float:
    """Deterministic branch score from the generated tokens alone (no log-probabilities needed).

    ``keyword hits + distinct-token ratio``: every case-insensitive occurrence of a keyword in the text
    counts 1, and the fraction of distinct token ids (0..1] rewards varied output over degenerate
    repetition loops, the most common failure of short greedy continuations. Empty output scores 0.
    """
    if not token_ids:
        return 0.0
    lowered = text.lower()
    hits = sum(lowered.count(k.lower()) for k in keywords)
    return hits + len(set(token_ids)) / len(token_ids)


class _Request(py_trees.behaviour.Behaviour):
    """Sends one request in ``initialise()``; SUCCESS / FAILURE from the response's ``success``."""

    def __init__(self, name, client, namespace, reads=(), writes=()):
        super().__init__(name)
        self.client = client
        self.bb = self.attach_blackboard_client(name=name, namespace=namespace)
        for key in reads:
            self.bb.register_key(key, access=Access.READ)
        for key in writes:
            self.bb.register_key(key, access=Access.WRITE)
        self._future = None
        self._deadline = 0.0

    def send(self):
        """Return the future of the request (a service response or a Generate result)."""
        raise NotImplementedError

    def on_success(self, response):
        """Record what the response says on the blackboard."""

    def initialise(self):
        self.feedback_message = ""
        self._deadline = time.monotonic() + self.client.timeout
        try:
            self._future = self.send()
        except (ClientError, KeyError) as exc:  # KeyError: a blackboard key that was never written
            self._future = None
            self.feedback_message = f"not sent: {exc}"

    def update(self):
        if self._future is None:
            return Status.FAILURE
        if not self._future.done():
            if time.monotonic() < self._deadline:
                return Status.RUNNING
            self.feedback_message = "no answer in time"
            return Status.FAILURE
        try:
            response = self._future.result()
        except ClientError as exc:  # e.g. the generate goal was rejected
            self.feedback_message = str(exc)
            return Status.FAILURE
        if not response.success:
            self.feedback_message = f"error_code {response.error_code}: {response.message}"
            return Status.FAILURE
        self.on_success(response)
        return Status.SUCCESS

    def terminate(self, new_status):
        if new_status == Status.INVALID and self._future is not None and not self._future.done():
            self._future.cancel()


class Snapshot(_Request):
    """Snapshot the live state; the new capsule's info goes to ``key``. ``pinned``: it never leaves the device."""

    def __init__(self, name, client, namespace, key, label, pinned=False):
        super().__init__(name, client, namespace, writes=[key])
        self.key, self.label, self.pinned = key, label, pinned

    def send(self):
        return self.client.call_async("snapshot", label=self.label, pinned=self.pinned)

    def on_success(self, response):
        self.bb.set(self.key, response.capsule)


class Restore(_Request):
    """Make the capsule stored under ``key`` the live state."""

    def __init__(self, name, client, namespace, key):
        super().__init__(name, client, namespace, reads=[key])
        self.key = key

    def send(self):
        return self.client.call_async("restore", capsule_id=self.bb.get(self.key).id)


class Generate(_Request):
    """Feed one candidate instruction through ``~/generate``; the result goes to ``key``."""

    def __init__(self, name, client, namespace, key, text, max_new_tokens, temperature):
        super().__init__(name, client, namespace, writes=[key])
        self.key, self.text = key, text
        self.max_new_tokens, self.temperature = max_new_tokens, temperature

    def send(self):
        return self.client.generate_async(self.text, self.max_new_tokens, temperature=self.temperature)

    def on_success(self, response):
        self.bb.set(self.key, response)


class DropCapsules(_Request):
    """Drop the capsules stored under ``keys`` (those that were written), except the one at ``keep``."""

    def __init__(self, name, client, namespace, keys, keep=None):
        super().__init__(name, client, namespace, reads=[*keys, *([keep] if keep else [])])
        self.keys, self.keep = keys, keep

    def send(self):
        keep = self.bb.get(self.keep).id if self.keep else None
        ids = {self.bb.get(k).id for k in self.keys if self.bb.exists(k)} - {keep}
        return _AllOf([self.client.call_async("drop_capsule", capsule_id=i) for i in sorted(ids)])


class _AllOf:
    """Several request futures seen as one: done when all are; its result is the first failed
    response, or a plain success."""

    def __init__(self, futures):
        self.futures = futures

    def done(self):
        return all(f.done() for f in self.futures)

    def result(self):
        responses = [f.result() for f in self.futures]
        return next((r for r in responses if not r.success), SimpleNamespace(success=True))

    def cancel(self):
        for f in self.futures:
            f.cancel()


class Score(py_trees.behaviour.Behaviour):
    """Score the generation under ``result_key`` with ``scorer(token_ids, text)`` into ``score_key``."""

    def __init__(self, name, namespace, result_key, score_key, scorer):
        super().__init__(name)
        self.bb = self.attach_blackboard_client(name=name, namespace=namespace)
        self.bb.register_key(result_key, access=Access.READ)
        self.bb.register_key(score_key, access=Access.WRITE)
        self.result_key, self.score_key, self.scorer = result_key, score_key, scorer

    def update(self):
        result = self.bb.get(self.result_key)
        self.bb.set(self.score_key, float(self.scorer(list(result.token_ids), result.text)))
        return Status.SUCCESS


class SelectBest(py_trees.behaviour.Behaviour):
    """Copy the capsule of the best-scoring finished branch to ``chosen``; FAILURE if none finished."""

    def __init__(self, name, namespace, count):
        super().__init__(name)
        self.count = count
        self.bb = self.attach_blackboard_client(name=name, namespace=namespace)
        for i in range(count):
            self.bb.register_key(f"score_{i}", access=Access.READ)
            self.bb.register_key(f"capsule_{i}", access=Access.READ)
        self.bb.register_key("chosen", access=Access.WRITE)
        self.bb.register_key("chosen_index", access=Access.WRITE)

    def update(self):
        finished = [i for i in range(self.count) if self.bb.exists(f"capsule_{i}")]
        if not finished:
            self.feedback_message = "no branch finished"
            return Status.FAILURE
        best = max(finished, key=lambda i: (self.bb.get(f"score_{i}"), -i))
        self.bb.set("chosen_index", best)
        self.bb.set("chosen", self.bb.get(f"capsule_{best}"))
        return Status.SUCCESS


def build_tree(client, candidates, namespace, *, scorer=score_tokens, max_new_tokens=16,
               temperature=0.0):
    """Return ``(root, branches)``: the planning tree and its per-candidate branch sequences."""
    branches = [
        py_trees.composites.Sequence(f"branch {i}", memory=True, children=[
            Restore(f"restore root {i}", client, namespace, "root"),
            Generate(f"generate {i}", client, namespace, f"result_{i}", text, max_new_tokens,
                     temperature),
            Score(f"score {i}", namespace, f"result_{i}", f"score_{i}", scorer),
            Snapshot(f"snapshot {i}", client, namespace, f"capsule_{i}", f"plan branch {i}"),
        ])
        for i, text in enumerate(candidates)
    ]
    capsule_keys = ["root"] + [f"capsule_{i}" for i in range(len(candidates))]
    plan = py_trees.composites.Sequence("plan", memory=True, children=[
        Snapshot("snapshot root", client, namespace, "root", "plan root", pinned=True),  # every branch restores it
        *[py_trees.decorators.FailureIsSuccess(f"try {b.name}", b) for b in branches],
        SelectBest("select best", namespace, len(candidates)),
        Restore("restore chosen", client, namespace, "chosen"),
        DropCapsules("drop the rest", client, namespace, capsule_keys, keep="chosen"),
    ])
    recover = py_trees.composites.Sequence("recover", memory=True, children=[
        Restore("restore root", client, namespace, "root"),
        DropCapsules("drop all", client, namespace, capsule_keys),
        py_trees.behaviours.Failure("planning failed"),
    ])
    return py_trees.composites.Selector("plan or recover", memory=True, children=[plan, recover]), branches


@dataclass(frozen=True)
class Branch:
    """How one candidate fared. Every finished branch has ``capsule`` info, but after planning only
    the chosen branch's capsule still exists on the node (the others were dropped)."""

    index: int
    candidate: str
    score: float | None
    token_ids: tuple
    text: str
    capsule: object | None  # flashrt_ros.msg.CapsuleInfo of the branch, before the drops
    error: str              # why the branch failed ("" if it finished)


@dataclass(frozen=True)
class PlanResult:
    """The chosen branch (its capsule is now the live state) and every branch in candidate order."""

    chosen: Branch
    branches: tuple


class PlanningError(RuntimeError):
    """No branch could be chosen; the live state was returned to the root and the capsules dropped."""

    def __init__(self, message, branches):
        super().__init__(message)
        self.branches = branches


class _FailureLog(py_trees.visitors.VisitorBase):
    """Remembers why each behaviour failed, as it happens (composites reset their children later)."""

    def __init__(self):
        super().__init__(full=False)
        self.reasons = {}

    def run(self, behaviour):
        if behaviour.status == Status.FAILURE and behaviour.feedback_message:
            self.reasons[behaviour] = f"{behaviour.name}: {behaviour.feedback_message}"

    def first(self, behaviours) -> str:
        return next((self.reasons[b] for b in behaviours if b in self.reasons), "")


def _collect_branches(namespace, candidates, branch_trees, failures):
    """Read every branch's outcome from the blackboard, and why it failed from ``failures``."""

    def get(key):
        path = f"{namespace}/{key}"
        return py_trees.blackboard.Blackboard.get(path) if py_trees.blackboard.Blackboard.exists(path) else None

    branches = []
    for i, (text, sequence) in enumerate(zip(candidates, branch_trees)):
        result = get(f"result_{i}")
        branches.append(Branch(index=i, candidate=text, score=get(f"score_{i}"),
                               token_ids=tuple(result.token_ids) if result else (),
                               text=result.text if result else "", capsule=get(f"capsule_{i}"),
                               error=failures.first(sequence.children)))
    return tuple(branches)


def run_planner(client, candidates, *, scorer=score_tokens, max_new_tokens=16, temperature=0.0,
                timeout=300.0, period=0.002) -> PlanResult:
    """Plan over ``candidates`` (instruction strings) with ``client`` (a FlashRTClient).

    On return the live state is the chosen branch's capsule (still kept, ``result.chosen.capsule``);
    the root and losing branch capsules are dropped. ``temperature=None`` uses the node's sampling.
    Raises :class:`PlanningError` when the tree fails (after its recovery restored the root and
    dropped the planning capsules) or runs past ``timeout`` (then the tree is stopped as it is).
    """
    if not candidates:
        raise ValueError("no candidates")
    namespace = f"/flashrt_plan_{next(_plan_ids)}"
    root, branch_trees = build_tree(client, candidates, namespace, scorer=scorer,
                                    max_new_tokens=max_new_tokens, temperature=temperature)
    tree = py_trees.trees.BehaviourTree(root)
    failures = _FailureLog()
    tree.visitors.append(failures)
    deadline = time.monotonic() + timeout
    try:
        tree.tick()
        while root.status == Status.RUNNING:
            if time.monotonic() > deadline:
                raise PlanningError(f"planning took longer than {timeout:.0f} s", ())
            time.sleep(period)
            tree.tick()
        branches = _collect_branches(namespace, candidates, branch_trees, failures)
        if root.status != Status.SUCCESS:
            plan, recover = root.children
            reason = failures.first(plan.children)
            cleanup = failures.first(recover.children[:-1])
            raise PlanningError(f"planning failed ({reason})" + (f"; cleanup failed ({cleanup})" if cleanup else ""),
                                branches)
        chosen = py_trees.blackboard.Blackboard.get(f"{namespace}/chosen_index")
        return PlanResult(chosen=branches[chosen], branches=branches)
    finally:
        if root.status == Status.RUNNING:
            root.stop(Status.INVALID)  # cancels the outstanding request
        for behaviour in root.iterate():
            for blackboard in behaviour.blackboards:
                blackboard.unregister(clear=True)


def main(argv=None) -> int:
    """Plan over the candidates given on the command line against a running ``flashrt`` node."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("candidates", nargs="+")
    parser.add_argument("--ns", default="/flashrt")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args(argv)

    import rclpy
    from flashrt_ros.client import FlashRTClient
    rclpy.init()
    node = rclpy.create_node("flashrt_bt_planner")
    client = FlashRTClient(node, args.ns)
    try:
        client.wait_ready()
        result = run_planner(client, args.candidates, max_new_tokens=args.max_new_tokens)
        for b in result.branches:
            print(f"[{b.index}] score={b.score} error={b.error!r} {b.candidate[:60]!r} -> {b.text!r}")
        print(f"chosen: [{result.chosen.index}] capsule {result.chosen.capsule.id} "
              f"at position {result.chosen.capsule.position}")
        return 0
    except (PlanningError, ClientError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
        node.destroy_node()
        rclpy.shutdown()


if __name__ == "__main__":
    sys.exit(main())
