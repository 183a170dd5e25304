"""The vidray Serve application's import path (`serve.app:build_app`); the code lives in `vidray.serve`."""
