//! `rdmablk`: command-line access to volumes of an rdmablk target.
//! Everything, logging setup included, lives in `rdmablk_initiator::cli`.

fn main() {
    std::process::exit(rdmablk_initiator::cli::main(std::env::args_os()));
}
