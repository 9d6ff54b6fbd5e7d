"""The step's closing call: everything the step reports back to the scheduler (placeholders
filled, drafts kept, forks, sampled tokens with their drafts, finishes), collected while the step
is booked and sent in one `Scheduler.update`, which applies all of it or nothing. If that call
raises, the reports go one by one, so only the request whose report fails is aborted."""

from __future__ import annotations

import logging
from typing import Optional

from pagedkv.engine.books import Books
from pagedkv.engine.request_state import RequestState

logger = logging.getLogger("pagedkv.engine.llm_engine")


class ClosingCall:
    """A step's reports, in the order the scheduler applies them (see `Scheduler.update`)."""

    def __init__(self):
        self.fill_ids: list[int] = []  # an asynchronous step's: placeholders filled in
        self.fill_tokens: list[int] = []
        self.accepted: dict[int, int] = {}  # seq_id -> drafts it keeps
        self.forks: list[tuple[int, int, bool]] = []  # (parent, child's first token, the child ends with it)
        self.seq_ids: list[int] = []  # appended to, with token_ids
        self.token_ids: list[int] = []
        self.drafts: dict[int, list[int]] = {}  # drafts after an appended sequence's token
        self.finished: list[int] = []
        self.child_ids: list[Optional[int]] = []  # after `close`: each fork's child (None: its request failed)

    def fill(self, seq_id: int, token_id: int, finished: bool) -> None:
        """The token for a sequence's placeholder; `finished`: the sequence ends with it."""
        self.fill_ids.append(seq_id)
        self.fill_tokens.append(token_id)
        if finished:
            self.finished.append(seq_id)

    def accept(self, seq_id: int, num_accepted: int) -> None:
        self.accepted[seq_id] = num_accepted

    def fork(self, parent: int, token_id: int, finished: bool) -> int:
        """A child of `parent` (forked before the parent's own token) whose first token is
        `token_id`; returns the index of its id in `child_ids` once closed."""
        self.forks.append((parent, token_id, finished))
        return len(self.forks) - 1

    def append(self, seq_id: int, token_id: int, drafts: Optional[list[int]] = None) -> None:
        self.seq_ids.append(seq_id)
        self.token_ids.append(token_id)
        if drafts:
            self.drafts[seq_id] = drafts

    def finish(self, seq_id: int) -> None:
        self.finished.append(seq_id)

    def close(self, scheduler, books: Books, touched: dict[str, RequestState], some_failed: bool) -> None:
        """Reports everything in one call; if that raises (it then changes nothing), one by one.
        `some_failed`: a request failed (and was aborted) after reporting: its reports are left out."""
        if some_failed:
            self._drop_failed(books)
        live_forks = [fork for fork in self.forks if not _failed(books, fork[0])] if some_failed else self.forks
        try:
            children = scheduler.update(
                self.seq_ids, self.token_ids, finished=self.finished, draft_token_ids=self.drafts or None,
                accepted_drafts=self.accepted or None, forks=live_forks or None,
                fill_seq_ids=self.fill_ids or None, fill_token_ids=self.fill_tokens or None)
        except Exception:
            logger.warning("closing the step in one call failed; reporting its sequences one by one")
            self._one_by_one(scheduler, books, touched)
            return
        children = iter(children)
        self.child_ids = [None if some_failed and _failed(books, parent) else next(children)
                          for parent, _, _ in self.forks]

    def _drop_failed(self, books: Books) -> None:
        def alive(seq_id: int) -> bool:
            return not _failed(books, seq_id)

        self.fill_ids, self.fill_tokens = _columns(pair for pair in zip(self.fill_ids, self.fill_tokens)
                                                   if alive(pair[0]))
        self.accepted = {seq_id: n for seq_id, n in self.accepted.items() if alive(seq_id)}
        self.seq_ids, self.token_ids = _columns(pair for pair in zip(self.seq_ids, self.token_ids) if alive(pair[0]))
        self.drafts = {seq_id: drafts for seq_id, drafts in self.drafts.items() if alive(seq_id)}
        self.finished = [seq_id for seq_id in self.finished if alive(seq_id)]
        # (forks keep their places, which are handed out; a failed request's child stays None)

    def _one_by_one(self, scheduler, books: Books, touched: dict[str, RequestState]) -> None:
        """Each report alone, in the closing call's order; a report that raises aborts its request
        (whose later reports are then skipped)."""
        def owner(seq_id: int) -> Optional[RequestState]:
            found = books.seq_owner.get(seq_id)
            return None if found is None or found[0].failed else found[0]

        for seq_id, token_id in zip(self.fill_ids, self.fill_tokens):
            if (request := owner(seq_id)) is not None:
                with books.isolated(request, touched, scheduler):
                    scheduler.fill_placeholders([seq_id], [token_id])
        for seq_id, num_accepted in self.accepted.items():
            if (request := owner(seq_id)) is not None:
                with books.isolated(request, touched, scheduler):
                    scheduler.accept_drafts(seq_id, num_accepted)
        self.child_ids = [None] * len(self.forks)
        for index, (parent, token_id, finished) in enumerate(self.forks):
            if (request := owner(parent)) is not None:
                with books.isolated(request, touched, scheduler):
                    child = self.child_ids[index] = scheduler.fork(parent)
                    if finished:
                        scheduler.finish_sequence(child)
                    else:
                        scheduler.append_token(child, token_id)
        for seq_id, token_id in zip(self.seq_ids, self.token_ids):
            if (request := owner(seq_id)) is not None:
                with books.isolated(request, touched, scheduler):
                    scheduler.append_token(seq_id, token_id, self.drafts.get(seq_id, []))
        for seq_id in self.finished:
            if (request := owner(seq_id)) is not None:
                with books.isolated(request, touched, scheduler):
                    scheduler.finish_sequence(seq_id)
        for index, (parent, _, _) in enumerate(self.forks):  # (a child of a request that failed after its fork)
            if _failed(books, parent):
                self.child_ids[index] = None


def _failed(books: Books, seq_id: int) -> bool:
    owner = books.seq_owner.get(seq_id)
    return owner is None or owner[0].failed


def _columns(pairs) -> tuple[list[int], list[int]]:
    pairs = list(pairs)
    return [first for first, _ in pairs], [second for _, second in pairs]
