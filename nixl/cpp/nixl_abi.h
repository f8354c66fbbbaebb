// The part of NIXL's backend interface that a plugin sees, declared here
// (not copied): the order and layout of NIXL 1.5.1 (`nixl-cu12==1.5.1` on
// PyPI; sources at github.com/ai-dynamo/nixl, src/api/cpp/backend/*.h,
// nixl_types.h, nixl_descriptors.h). NIXL's core calls a plugin's engine
// through its vtable and reads the base class's members inline, so both
// must match that release byte for byte:
//   - nixl/tests/test_nixl.py::test_vtable_matches_nixl compares this
//     build's vtable, slot by slot, with the one NIXL's own POSIX plugin of
//     the installed wheel was built with (a method moved fails it);
//   - the static_asserts below pin the sizes the disassembly of that
//     release shows (e.g. `initErr` at byte 160 of the engine object).
// Build with FERRY_NIXL_ABI_MUTATION=1 to move one method and see the test
// fail (what a wrong layout looks like).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

enum nixl_mem_t { DRAM_SEG, VRAM_SEG, BLK_SEG, OBJ_SEG, FILE_SEG };
enum nixl_xfer_op_t { NIXL_READ, NIXL_WRITE };
enum nixl_status_t {
    NIXL_IN_PROG = 1,
    NIXL_SUCCESS = 0,
    NIXL_ERR_NOT_POSTED = -1,
    NIXL_ERR_INVALID_PARAM = -2,
    NIXL_ERR_BACKEND = -3,
    NIXL_ERR_NOT_FOUND = -4,
    NIXL_ERR_MISMATCH = -5,
    NIXL_ERR_NOT_ALLOWED = -6,
    NIXL_ERR_REPOST_ACTIVE = -7,
    NIXL_ERR_UNKNOWN = -8,
    NIXL_ERR_NOT_SUPPORTED = -9,
    NIXL_ERR_REMOTE_DISCONNECT = -10,
    NIXL_ERR_CANCELED = -11,
    NIXL_ERR_NO_TELEMETRY = -12
};
enum class nixl_thread_sync_t { NIXL_THREAD_SYNC_NONE, NIXL_THREAD_SYNC_STRICT, NIXL_THREAD_SYNC_RW };
enum class nixl_cost_t { ANALYTICAL_BACKEND = 0 };

using nixl_backend_t = std::string;
using nixl_blob_t = std::string;
using nixl_mem_list_t = std::vector<nixl_mem_t>;
using nixl_b_params_t = std::unordered_map<std::string, std::string>;
using nixl_query_resp_t = std::optional<nixl_b_params_t>;
using nixlMemViewH = void *;
using notif_list_t = std::vector<std::pair<std::string, std::string>>;

// Only ever passed by pointer to a method this plugin does not implement.
class nixlAgentOptionalArgs;

class nixlBasicDesc {
public:
    uintptr_t addr;
    size_t len;
    uint64_t devId;
};

class nixlBlobDesc : public nixlBasicDesc {
public:
    nixl_blob_t metaInfo;
};

// NIXL's list has a vtable (virtual destructor and resize); the plugin
// only reads lists NIXL made, so nothing virtual is declared or called:
// `vptr_` stands for the pointer.
template <class T> class nixlDescList {
protected:
    void *vptr_;
    nixl_mem_t type;
    std::vector<T> descs;

public:
    nixlDescList() = delete;
    nixl_mem_t getType() const { return type; }
    size_t descCount() const { return descs.size(); }
    const T &operator[](size_t i) const { return descs[i]; }
};

class nixlBackendMD {
protected:
    bool isPrivateMD;

public:
    explicit nixlBackendMD(bool is_private) : isPrivateMD(is_private) {}
    virtual ~nixlBackendMD() {}
};

class nixlBackendReqH {
public:
    nixlBackendReqH() {}
    virtual ~nixlBackendReqH() {}
};

class nixlMetaDesc : public nixlBasicDesc {
public:
    nixlBackendMD *metadataP;
};

struct nixlRemoteMetaDesc : public nixlMetaDesc {
    std::string remoteAgent;
};

using nixl_meta_dlist_t = nixlDescList<nixlMetaDesc>;
using nixl_remote_meta_dlist_t = nixlDescList<nixlRemoteMetaDesc>;
using nixl_reg_dlist_t = nixlDescList<nixlBlobDesc>;

struct nixlBackendOptionalArgs {
    nixl_blob_t notifMsg;
    bool hasNotif = false;
    nixl_blob_t customParam;
};
using nixl_opt_b_args_t = nixlBackendOptionalArgs;

class nixlBackendInitParams {
public:
    std::string localAgent;
    nixl_backend_t type;
    nixl_b_params_t *customParams = nullptr;
    bool enableProgTh = false;
    uint64_t pthrDelay = 0;
    nixl_thread_sync_t syncMode;
    bool enableTelemetry_ = false;
};

// Its element type is not ours to know; only the vector's own layout
// matters (NIXL's core moves it out under the mutex).
struct nixlTelemetryEvent;

class nixlBackendEngine {
private:
    nixl_backend_t backendType;
    nixl_b_params_t customParams;
    std::vector<nixlTelemetryEvent *> telemetryEvents_;
    std::mutex telemetryEventsMutex_;

protected:
    bool initErr = false;
    const std::string localAgent;
    const bool enableTelemetry_;

public:
    explicit nixlBackendEngine(const nixlBackendInitParams *p)
        : backendType(p->type), customParams(*p->customParams), localAgent(p->localAgent),
          enableTelemetry_(p->enableTelemetry_) {}
    nixlBackendEngine(const nixlBackendEngine &) = delete;
    void operator=(const nixlBackendEngine &) = delete;
    virtual ~nixlBackendEngine() = default;

    virtual bool supportsRemote() const = 0;
    virtual bool supportsLocal() const = 0;
    virtual bool supportsNotif() const = 0;
    virtual nixl_mem_list_t getSupportedMems() const = 0;
    virtual nixl_status_t
    registerMem(const nixlBlobDesc &mem, const nixl_mem_t &nixl_mem, nixlBackendMD *&out) = 0;
    virtual nixl_status_t deregisterMem(nixlBackendMD *meta) = 0;
    virtual nixl_status_t connect(const std::string &remote_agent) = 0;
    virtual nixl_status_t disconnect(const std::string &remote_agent) = 0;
    virtual nixl_status_t unloadMD(nixlBackendMD *input) = 0;
    virtual nixl_status_t prepXfer(const nixl_xfer_op_t &operation, const nixl_meta_dlist_t &local,
                                   const nixl_meta_dlist_t &remote, const std::string &remote_agent,
                                   nixlBackendReqH *&handle,
                                   const nixl_opt_b_args_t *opt_args = nullptr) const = 0;
    virtual nixl_status_t postXfer(const nixl_xfer_op_t &operation, const nixl_meta_dlist_t &local,
                                   const nixl_meta_dlist_t &remote, const std::string &remote_agent,
                                   nixlBackendReqH *&handle,
                                   const nixl_opt_b_args_t *opt_args = nullptr) const = 0;
#ifdef FERRY_NIXL_ABI_MUTATION
    // The deliberately wrong layout: two methods swapped.
    virtual nixl_status_t releaseReqH(nixlBackendReqH *handle) const = 0;
    virtual nixl_status_t checkXfer(nixlBackendReqH *handle) const = 0;
#else
    virtual nixl_status_t checkXfer(nixlBackendReqH *handle) const = 0;
    virtual nixl_status_t releaseReqH(nixlBackendReqH *handle) const = 0;
#endif
    virtual nixl_status_t
    prepMemView(const nixl_remote_meta_dlist_t &, nixlMemViewH &,
                const nixl_opt_b_args_t * = nullptr) const {
        return NIXL_ERR_NOT_SUPPORTED;
    }
    virtual nixl_status_t
    prepMemView(const nixl_meta_dlist_t &, nixlMemViewH &, const nixl_opt_b_args_t * = nullptr) const {
        return NIXL_ERR_NOT_SUPPORTED;
    }
    virtual void releaseMemView(nixlMemViewH) const {}
    virtual nixl_status_t getPublicData(const nixlBackendMD *, std::string &) const {
        return NIXL_ERR_BACKEND;
    }
    virtual nixl_status_t getConnInfo(std::string &) const { return NIXL_ERR_BACKEND; }
    virtual nixl_status_t loadRemoteConnInfo(const std::string &, const std::string &) {
        return NIXL_ERR_BACKEND;
    }
    virtual nixl_status_t
    loadRemoteMD(const nixlBlobDesc &, const nixl_mem_t &, const std::string &, nixlBackendMD *&) {
        return NIXL_ERR_BACKEND;
    }
    virtual nixl_status_t loadLocalMD(nixlBackendMD *, nixlBackendMD *&) { return NIXL_ERR_BACKEND; }
    virtual nixl_status_t getNotifs(notif_list_t &) { return NIXL_ERR_BACKEND; }
    virtual nixl_status_t genNotif(const std::string &, const std::string &) const {
        return NIXL_ERR_BACKEND;
    }
    virtual nixl_status_t
    queryMem(const nixl_reg_dlist_t &, std::vector<nixl_query_resp_t> &) const {
        return NIXL_ERR_NOT_SUPPORTED;
    }
    virtual nixl_status_t
    estimateXferCost(const nixl_xfer_op_t &, const nixl_meta_dlist_t &, const nixl_meta_dlist_t &,
                     const std::string &, nixlBackendReqH *const &, std::chrono::microseconds &,
                     std::chrono::microseconds &, nixl_cost_t &,
                     const nixlAgentOptionalArgs * = nullptr) const {
        return NIXL_ERR_NOT_SUPPORTED;
    }
};

// The plugin record NIXL's core reads from nixl_plugin_init().
#define NIXL_PLUGIN_API_VERSION 1
class nixlBackendPlugin {
public:
    int api_version;
    nixlBackendEngine *(*create_engine)(const nixlBackendInitParams *init_params);
    void (*destroy_engine)(nixlBackendEngine *engine);
    const char *(*get_plugin_name)();
    const char *(*get_plugin_version)();
    nixl_b_params_t (*get_backend_options)();
    nixl_mem_list_t (*get_backend_mems)();
};

// Sizes of NIXL 1.5.1 on x86-64 / libstdc++ (C++11 string ABI).
static_assert(sizeof(nixlBasicDesc) == 24);
static_assert(sizeof(nixlMetaDesc) == 32);
static_assert(sizeof(nixlBlobDesc) == 56);
static_assert(sizeof(nixlDescList<nixlMetaDesc>) == 40);
static_assert(sizeof(nixlBackendOptionalArgs) == 72);
static_assert(sizeof(nixlBackendInitParams) == 96);
static_assert(sizeof(nixlBackendEngine) == 208);
static_assert(sizeof(nixlBackendPlugin) == 56);
