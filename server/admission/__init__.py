"""Admission: the server's bounds in one table (`limits`), the two primitives that enforce
them (`pools` of places, `budgets` of amounts, per caller as `callers` counts), a call's
own record (`calls`), examples and bytes held by calls (`inflight`), and requests refused
from their bytes before they are parsed (`unparsed`)."""
