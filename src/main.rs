#![forbid(unsafe_code)]

fn main() {
    std::process::exit(trueno_ublk::cli::main());
}
