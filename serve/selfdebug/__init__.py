"""Self-debugging code evaluation (issue 6, in progress): datasets so far; the sandbox, the
generate -> test -> feedback -> repair loop and the reports are still to come."""
