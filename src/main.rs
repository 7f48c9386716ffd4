#![forbid(unsafe_code)]

fn main() {
    // Installed as a systemd generator under another name (a link to this binary).
    let as_generator = std::env::args_os()
        .next()
        .map(std::path::PathBuf::from)
        .and_then(|argv0| argv0.file_name().map(|name| name.to_owned()))
        .is_some_and(|name| name == trueno_ublk::generator::GENERATOR_NAME);
    if as_generator {
        std::process::exit(trueno_ublk::generator::main());
    }
    std::process::exit(trueno_ublk::cli::main());
}
