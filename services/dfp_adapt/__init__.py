"""The adaptation loop: captured traffic in, a candidate drafter trained, evaluated and served only when it is better."""
