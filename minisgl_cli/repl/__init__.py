"""`minisgl chat`: the interactive REPL — session state (session.py), rendering (view.py), the loop (app.py)."""
