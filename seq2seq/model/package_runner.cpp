// A compiled package's model (model/packaged.py), called without the GIL: torch's own Python binding of
// AOTIModelPackageLoader (torch._C._aoti) holds it while the model runs, so decoder threads sharing a package
// run their steps one at a time, where a step of torch.compile's C++ wrapper (inductor.CPP_WRAPPER) releases it.
//
//   Runner(path, runners): the .pt2's model, with `runners` instances (as many calls at once)
//   Runner.run(inputs) -> outputs: the model's flat tensors in and out (packaged._Runner puts them in the
//   function's structure); the GIL released while it runs
//   Runner.call_spec() -> [inputs' structure, outputs' structure], torch.utils._pytree's serialised specs

#include <torch/csrc/utils/pybind.h>  // (not torch/extension.h: that brings the whole C++ frontend, compiled for minutes)
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <string>
#include <vector>

namespace {

class Runner {
 public:
  Runner(const std::string& path, int64_t runners)
      : loader_(path, "model", /*run_single_threaded=*/false, static_cast<size_t>(runners), /*device_index=*/-1) {}

  std::vector<at::Tensor> run(std::vector<at::Tensor> inputs) {
    pybind11::gil_scoped_release unlocked;  // (the inputs converted already; the outputs converted after)
    return loader_.boxed_run(std::move(inputs));
  }

  std::vector<std::string> call_spec() { return loader_.get_call_spec(); }

 private:
  torch::inductor::AOTIModelPackageLoader loader_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Runner>(m, "Runner")
      .def(pybind11::init<const std::string&, int64_t>())
      .def("run", &Runner::run)
      .def("call_spec", &Runner::call_spec);
}
