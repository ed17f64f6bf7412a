"""What the shipped binaries are linked with."""


def without_run_paths(link_command):
    """The interpreter's link command less the run paths it may carry (pyenv's and
    conda's add their own lib folder): nothing built here needs them, and the
    shipped library would name the build machine's folder to every program it loads in."""
    kept, skip_next = [], False
    for arg in link_command:
        if skip_next:  # the folder of a split "-Wl,-rpath" "-Wl,DIR"
            skip_next = False
        elif arg in ("-Wl,-rpath", "-Wl,--rpath", "-Wl,-R"):
            skip_next = True
        elif not arg.startswith(("-Wl,-rpath,", "-Wl,-rpath=", "-Wl,--rpath", "-Wl,-R")):
            kept.append(arg)
    return kept
