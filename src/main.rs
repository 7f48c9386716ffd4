fn main() {
    std::process::exit(trueno_ublk::cli::main());
}
