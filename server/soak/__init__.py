"""`python -m server.soak --minutes 5`: a bounded soak test of the whole app as a visitor meets it. Browser visitors
race and chat at once while API clients stream completions (some dropping their streams); it stops by itself at the
deadline, lets the actions in flight finish, then checks what must hold after sustained mixed use: consistent panels,
waits within a bound derived from each action's solo time and its reply's length, no KV block held at the end, RSS
flat after the warm-up, no 5xx, no traceback in the server's log. The exit status is 1 when a check fails.

Modules: `checks` (pure: panels, bounds, RSS slope, log), `visitors` (the browser visitors), `run` (the app's
process, the API clients, the phases), `report` (the rows, the checks' verdicts, docs/soak.md), `__main__` (flags).
"""
