"""Runs in the user's kernel: the %colossal magics, the layout picker, engines' output, notebook export."""
