// aoti_runner: run an AOTInductor package (.pt2) that calls custom ops, with no
// Python in the process.
//
//   aoti_runner --library OP_LIBRARY [--library ...] --package MODEL.pt2
//               --inputs IN.pt --outputs OUT.pt [--device cpu|cuda|cuda:N]
//
// OP_LIBRARY is an op package's compiled library (`python -m <op>
// --library-path` prints it): loading it registers the ops with torch's
// dispatcher, which is all the package's calls to them need. IN.pt holds a
// list of tensors (Python: `torch.save([x, ...], "IN.pt")`), moved to
// --device before the run; OUT.pt receives the list of outputs, on the CPU
// (Python: `torch.load("OUT.pt")`, inside `torch.serialization.safe_globals(
// [torch.jit._pickle.build_tensorlist])` with weights_only). The runner fails
// (exit status 3) if libpython is mapped into its process at the end of the
// run: the deployment promise is that nothing of Python is needed.
//
// Build: CMakeLists.txt next to this file, or one compiler line (see the
// top-level README, "Deploying").

#include <dlfcn.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <c10/core/InferenceMode.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/csrc/jit/serialization/pickle.h>

namespace {

struct Args {
  std::vector<std::string> libraries;
  std::string package, inputs, outputs, device = "cpu";
};

[[noreturn]] void usage(const std::string& why) {
  std::cerr << "aoti_runner: " << why << "\n"
            << "usage: aoti_runner --library OP_LIBRARY [--library ...] --package MODEL.pt2 "
               "--inputs IN.pt --outputs OUT.pt [--device cpu|cuda|cuda:N]\n";
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (i + 1 >= argc) usage("missing value after " + flag);
    std::string value = argv[++i];
    if (flag == "--library") {
      a.libraries.push_back(value);
    } else if (flag == "--package") {
      a.package = value;
    } else if (flag == "--inputs") {
      a.inputs = value;
    } else if (flag == "--outputs") {
      a.outputs = value;
    } else if (flag == "--device") {
      a.device = value;
    } else {
      usage("unknown argument " + flag);
    }
  }
  if (a.package.empty() || a.inputs.empty() || a.outputs.empty()) {
    usage("--package, --inputs and --outputs are required");
  }
  return a;
}

std::vector<char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// The mappings of this process whose file name contains "libpython".
std::vector<std::string> python_mappings() {
  std::ifstream maps("/proc/self/maps");
  std::vector<std::string> found;
  for (std::string line; std::getline(maps, line);) {
    if (line.find("libpython") != std::string::npos) found.push_back(line);
  }
  return found;
}

}  // namespace

int main(int argc, char** argv) {
  Args args = parse(argc, argv);
  try {
    for (const auto& lib : args.libraries) {
      // RTLD_GLOBAL: the op library's static initializers register its ops
      // with the dispatcher of the libtorch this program is linked against.
      if (dlopen(lib.c_str(), RTLD_NOW | RTLD_GLOBAL) == nullptr) {
        std::cerr << "aoti_runner: cannot load op library " << lib << ": " << dlerror() << "\n";
        return 1;
      }
    }
    const c10::Device device(args.device);
    c10::InferenceMode no_autograd;

    // Named: the list must outlive the loop over it.
    const c10::IValue loaded = torch::jit::pickle_load(read_file(args.inputs));
    if (!loaded.isList())
      throw std::runtime_error(args.inputs + " does not hold a list of tensors");
    std::vector<at::Tensor> inputs;
    for (const auto& v : loaded.toListRef()) {
      inputs.push_back(v.toTensor().to(device));
    }
    torch::inductor::AOTIModelPackageLoader loader(args.package);
    std::vector<at::Tensor> outputs = loader.run(inputs);

    c10::List<at::Tensor> saved;
    for (const auto& t : outputs) saved.push_back(t.cpu());
    std::vector<char> bytes = torch::jit::pickle_save(c10::IValue(saved));
    std::ofstream out(args.outputs, std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out) throw std::runtime_error("cannot write " + args.outputs);
    out.close();

    std::vector<std::string> python = python_mappings();
    if (!python.empty()) {
      std::cerr << "aoti_runner: libpython is mapped into this process:\n";
      for (const auto& line : python) std::cerr << "  " << line << "\n";
      return 3;
    }
    std::cout << "aoti_runner: ran " << args.package << " on " << device << ": " << inputs.size()
              << " input(s), " << outputs.size() << " output(s); no libpython mapped\n";
  } catch (const c10::Error& e) {
    // torch's message without its C++ backtrace.
    const std::string message = e.what_without_backtrace();
    std::cerr << "aoti_runner: " << message << "\n";
    if (message.find("Could not find schema") != std::string::npos) {
      std::cerr << "aoti_runner: the package calls an operator that no loaded library registers: "
                   "pass the op package's library with --library (`python -m <package> "
                   "--library-path` prints it)\n";
    }
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "aoti_runner: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
