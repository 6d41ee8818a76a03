"""Admission: the server's bounds in one table (`limits`), and what enforces the budgets
among them: examples and bytes held by calls (`inflight`), a caller's refused bytes over
a window (`refused`)."""
